"""Key smoothing for a quantized KV cache, calibrated once when the model loads (docs/engine.md, "Quantized KV cache").

Keys have outlier channels: a few of a head's channels are many times larger than the rest in every token, so a
per-(token, head) scale set by them leaves the other channels a handful of int8 levels (KIVI, Liu et al. 2024,
which therefore quantizes keys per channel). A paged cache fills a block one decode token at a time, so a
per-channel scale cannot be taken from the block's own tokens without re-quantizing it; instead each channel's
range is measured once, on a fixed calibration batch, and moved into the query (SmoothQuant, Xiao et al. 2023):
the cache stores ``k / s`` and attention multiplies ``q`` by ``s``, so ``q . k`` is unchanged.

``s = absmax ** alpha`` per (layer, KV head, channel) over the calibration keys (after RoPE and any key norm, as
they are stored), with ``alpha = 0.5`` (SmoothQuant's balance), normalised to a mean of 1 per head and floored
at 1% of the head's largest (a channel silent at calibration must not blow up later). The per-token scales
(one per group of 32 channels, :func:`kernels.reference.quantize_kv`) stay on top, so a key larger than any
calibration key still cannot overflow. The calibration batch is :data:`NUM_CALIBRATION_SEQS` sequences of
:data:`CALIBRATION_LEN` token ids drawn uniformly with a fixed seed: model-independent and deterministic (every
engine on a model gets the same factors, so prefix caching and the reference engines of the tests agree), and on
SmolLM2 it covered the key ranges of real prompts better than HumanEval prompts did (``bench/kv_quant.py
--quality``: 99.56% against 99.37% agreement).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.engine.executor.layers.attention import scratch_prefill_metadata

NUM_CALIBRATION_SEQS = 4
CALIBRATION_LEN = 256
CALIBRATION_SEED = 0
SMOOTHING_ALPHA = 0.5
SMOOTHED_KV_CACHE_DTYPES = ("int8", "int4")
"""The cache dtypes whose keys are smoothed: the even grids of int8 and int4 (int4's groups: 93.41% -> 94.97%
on 16 x 128). float8 spends its bits on an exponent, so a small channel keeps its relative precision beside an
outlier; smoothing it cost agreement (98.73% -> 98.19% on 16 x 128)."""
MIN_SMOOTHING_RATIO = 1e-2


def calibration_token_ids(vocab_size: int) -> list[list[int]]:
    """The fixed calibration batch: :data:`NUM_CALIBRATION_SEQS` lists of :data:`CALIBRATION_LEN` ids in
    ``[0, vocab_size)``, drawn with seed :data:`CALIBRATION_SEED`."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, vocab_size, (NUM_CALIBRATION_SEQS, CALIBRATION_LEN), generator=generator)
    return ids.tolist()


def smoothing_from_key_absmax(key_absmax: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """Smoothing factors ``absmax ** alpha`` from float32 ``key_absmax: [..., head_size]`` (a channel's largest
    ``|k|``), floored at :data:`MIN_SMOOTHING_RATIO` of each row's largest and normalised to a mean of 1 per row
    (an all-zero row gives ones). Returns float32, the shape of ``key_absmax``, every entry positive."""
    floor = key_absmax.amax(-1, keepdim=True) * MIN_SMOOTHING_RATIO
    smoothing = key_absmax.maximum(floor).pow(alpha)
    smoothing = torch.where(smoothing > 0, smoothing, torch.ones_like(smoothing))
    return smoothing / smoothing.mean(-1, keepdim=True)


@torch.no_grad()
def calibrate_key_smoothing(
    model: nn.Module,
    *,
    vocab_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    num_queries_per_kv: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    device: torch.device,
    use_cpu_kernels: bool,
    use_triton_kernels: bool,
) -> list[torch.Tensor]:
    """One float32 ``[num_kv_heads, head_size]`` smoothing per layer (module docstring): the model runs the
    calibration batch as one prefill step into a throw-away cache in ``dtype``, whose stored keys are measured.

    ``model`` is called as the model runner calls it (``model(input_ids, positions, kv_caches, attn_metadata)``);
    nothing of it is mutated.
    """
    token_ids = calibration_token_ids(vocab_size)
    block_size = 16
    scratch = scratch_prefill_metadata(
        [CALIBRATION_LEN] * len(token_ids),
        block_size,
        num_queries_per_kv=num_queries_per_kv,
        dtype=dtype,
        device=device,
        sliding_window=sliding_window,
        use_cpu_kernels=use_cpu_kernels,
        use_triton_kernels=use_triton_kernels,
    )
    kv_caches = [
        torch.zeros(2, scratch.num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]
    input_ids = torch.tensor([i for ids in token_ids for i in ids], dtype=torch.long, device=device)
    model(input_ids, scratch.metadata.positions, kv_caches, scratch.metadata)
    return [smoothing_from_key_absmax(kv_cache[0].float().abs().amax(dim=(0, 1)).cpu()) for kv_cache in kv_caches]
