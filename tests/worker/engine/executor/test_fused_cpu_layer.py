"""The fused decoder layer on the C++ kernels (models/llama.py ``FusedCpuLayer``; docs/engine.md, "Quantized
weights" and "The mixed workload's step on the Zen 4"): the same bits as the module path, for packed float32, int8
and q4 weights, and packed bfloat16 weights and Q4 panels (alone or mixed in a layer) on a bfloat16 model (where the
CPU has AVX512_BF16)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_elementwise import PACKED_BF16_KIND, gguf_bf16_kind
from kernels.cpu_gemm import linear_bf16_supported
from tests.kernels.conftest import cpu_kernels  # noqa: F401 (the fixture: kernels built, one thread)
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.executor.layers.linear import PackedLinear
from worker.engine.executor.layers.quantization.q4 import GGUFLinear, GGUFLinearBF16
from worker.engine.executor.models.llama import LlamaDecoderLayer, enable_cpu_kernels

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
    [("none", "float32"), ("int8", "float32"), ("q4", "float32"), ("none", "bfloat16"), ("q4", "bfloat16")],
)
def test_fused_layers_give_the_module_paths_bits(model_dir, quantization, dtype):
    if dtype == "bfloat16" and not linear_bf16_supported():
        pytest.skip("the packed bfloat16 linear and the bfloat16 Q4 kernels need AVX512_BF16")
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
    if (quantization, dtype) == ("q4", "bfloat16"):
        # Q4_1 panels at load (the tiny model has no GGUF); then one layer's o_proj a packed bfloat16 weight: a layer
        # mixing the two bfloat16 kinds stays fused.
        assert {f.qkv.kind for f in fused} == {gguf_bf16_kind(3)}
        o_proj = layers[0].self_attn.o_proj
        assert isinstance(o_proj, GGUFLinearBF16)
        generator = torch.Generator().manual_seed(0)
        dense = torch.nn.Linear(o_proj.in_features, o_proj.out_features, bias=False, dtype=torch.bfloat16)
        dense.weight.data = (torch.randn(dense.weight.shape, generator=generator) * 0.05).to(torch.bfloat16)
        layers[0].self_attn.o_proj = PackedLinear(dense)
        enable_cpu_kernels(engine.model_runner.model)
        fused = [layer.fused_cpu for layer in layers]
        assert fused[0] is not None and fused[0].o.kind == PACKED_BF16_KIND
        assert fused[0].gate_up.kind == gguf_bf16_kind(3)
        logits, tokens = _logits_and_tokens(engine, prompts)
        want_logits, want_tokens = module_path()
        assert tokens == want_tokens and all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))
    if (quantization, dtype) == ("q4", "float32"):
        # int8 activations are not the fused kernels' path: such a layer runs its modules.
        for module in engine.model_runner.model.modules():
            if isinstance(module, GGUFLinear):
                module.quantize_activations = True
        logits, tokens = _logits_and_tokens(engine, prompts)
        want_logits, want_tokens = module_path()
        assert tokens == want_tokens and all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))
