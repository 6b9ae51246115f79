"""The fused decoder layer on the C++ kernels (models/llama.py ``FusedCpuLayer``; docs/engine.md, "Quantized
weights" and "The mixed workload's step on the Zen 4"): the same bits as the module path, for packed float32, int8
and q4 weights, and packed bfloat16 weights on a bfloat16 model (where the CPU has AVX512_BF16)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_gemm import linear_bf16_supported
from tests.kernels.conftest import cpu_kernels  # noqa: F401 (the fixture: kernels built, one thread)
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.executor.layers.quantization.q4 import GGUFLinear
from worker.engine.executor.models.llama import LlamaDecoderLayer

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _logits_and_tokens(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every step's logits and each prompt's greedy tokens (a prefill of three sequences, then their decode)."""
    model = engine.model_runner.model
    logits: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def capture(hidden_states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = compute_logits(hidden_states)
        logits.append(out.clone())
        return out

    model.compute_logits = capture
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    finally:
        del model.compute_logits
    return logits, [list(out.outputs[0].token_ids) for out in outputs]


@pytest.mark.parametrize(
    ("quantization", "dtype"),
    [("none", "float32"), ("int8", "float32"), ("q4", "float32"), ("none", "bfloat16")],
)
def test_fused_layers_give_the_module_paths_bits(model_dir, quantization, dtype):
    if dtype == "bfloat16" and not linear_bf16_supported():
        pytest.skip("the packed bfloat16 linear kernel needs AVX512_BF16")
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            quantization=quantization,
            dtype=dtype,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=16 << 20,
            max_model_len=256,
        )
    )
    layers = [m for m in engine.model_runner.model.modules() if isinstance(m, LlamaDecoderLayer)]
    fused = [layer.fused_cpu for layer in layers]
    assert layers and all(f is not None and f.dtype == getattr(torch, dtype) for f in fused)
    prompts = [list(range(3, 40)), list(range(50, 59)), [5, 6]]

    def module_path() -> tuple[list[torch.Tensor], list[list[int]]]:
        for layer in layers:
            layer.fused_cpu = None
        try:
            return _logits_and_tokens(engine, prompts)
        finally:
            for layer, f in zip(layers, fused, strict=True):
                layer.fused_cpu = f

    logits, tokens = _logits_and_tokens(engine, prompts)
    want_logits, want_tokens = module_path()
    assert tokens == want_tokens
    assert len(logits) == len(want_logits) and all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))
    if quantization == "q4":
        # int8 activations are not the fused kernels' path: such a layer runs its modules.
        for module in engine.model_runner.model.modules():
            if isinstance(module, GGUFLinear):
                module.quantize_activations = True
        logits, tokens = _logits_and_tokens(engine, prompts)
        want_logits, want_tokens = module_path()
        assert tokens == want_tokens and all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))
