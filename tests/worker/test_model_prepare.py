import json

import numpy as np
import pytest

from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL, get_settings
from worker.model_prepare import ModelNotFoundError, builtin_gguf_path, check_model, link_gguf, prepare_model


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter layout: each head's two rotary halves interleaved row by row."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_local_folder_is_served_as_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert prepare_model(str(tmp_path)) == tmp_path.resolve()


def test_the_converted_folder_links_its_gguf(tmp_path):
    """quantization='q4' reads the GGUF's blocks from the model folder; linking twice is harmless."""
    link_gguf(tmp_path)
    link_gguf(tmp_path)
    (link,) = tmp_path.glob("*.gguf")
    assert link.is_symlink() and link.resolve() == builtin_gguf_path().resolve()


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither"):
        prepare_model(str(tmp_path / "missing"))


@pytest.mark.slow
def test_builtin_embedding_model_is_unzipped_into_the_cache_once(tmp_path):
    folder = prepare_model(BUILTIN_EMBEDDING_MODEL, tmp_path)

    assert folder == tmp_path / BUILTIN_EMBEDDING_MODEL
    assert {"config.json", "model.safetensors", "modules.json", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert (folder / "1_Pooling" / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [BUILTIN_EMBEDDING_MODEL]  # no staging folder left behind
    assert prepare_model(BUILTIN_EMBEDDING_MODEL, tmp_path) == folder


def test_builtin_model_converts_and_answers(served_model_dir):
    config = json.loads((served_model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["rope_parameters"]["rope_theta"] == 100_000 and config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation_config = json.loads((served_model_dir / "generation_config.json").read_text())
    assert (generation_config["bos_token_id"], generation_config["eos_token_id"]) == (1, 2)
    check_model(served_model_dir)


@pytest.mark.slow
def test_builtin_weights_equal_the_dequantized_gguf(served_model_dir):
    """transformers' conversion against ``gguf.dequantize`` and llama.cpp's documented q/k row layout."""
    from gguf import GGUFReader, dequantize
    from safetensors.numpy import load_file

    config = json.loads((served_model_dir / "config.json").read_text())
    weights = load_file(served_model_dir / "model.safetensors")
    gguf_tensors = {tensor.name: tensor for tensor in GGUFReader(builtin_gguf_path()).tensors}

    def dequantized(name: str) -> np.ndarray:
        tensor = gguf_tensors[name]
        return dequantize(tensor.data, tensor.tensor_type).reshape([int(d) for d in reversed(tensor.shape)])

    # Tied embeddings: the GGUF has no output.weight, and the folder stores no lm_head.
    assert "output.weight" not in gguf_tensors and "lm_head.weight" not in weights
    assert len(weights) == len(gguf_tensors)
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    expected = {  # HF name: (GGUF name, heads whose rows llama.cpp permuted, or None)
        "model.embed_tokens.weight": ("token_embd.weight", None),
        "model.norm.weight": ("output_norm.weight", None),
        "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", num_heads),
        "model.layers.0.self_attn.k_proj.weight": ("blk.0.attn_k.weight", num_kv_heads),
        "model.layers.29.self_attn.q_proj.weight": ("blk.29.attn_q.weight", num_heads),
        "model.layers.29.self_attn.k_proj.weight": ("blk.29.attn_k.weight", num_kv_heads),
        "model.layers.7.self_attn.v_proj.weight": ("blk.7.attn_v.weight", None),
        "model.layers.7.self_attn.o_proj.weight": ("blk.7.attn_output.weight", None),
        "model.layers.13.mlp.gate_proj.weight": ("blk.13.ffn_gate.weight", None),
        "model.layers.13.mlp.up_proj.weight": ("blk.13.ffn_up.weight", None),
        "model.layers.13.mlp.down_proj.weight": ("blk.13.ffn_down.weight", None),
        "model.layers.13.input_layernorm.weight": ("blk.13.attn_norm.weight", None),
        "model.layers.13.post_attention_layernorm.weight": ("blk.13.ffn_norm.weight", None),
    }
    for hf_name, (gguf_name, permuted_heads) in expected.items():
        weight = weights[hf_name]
        assert weight.dtype == np.float32, hf_name
        if permuted_heads is not None:
            weight = _llama_cpp_permute(weight, permuted_heads)
        assert np.array_equal(weight, dequantized(gguf_name)), hf_name


def test_builtin_model_is_found_in_the_configured_cache(tmp_path, monkeypatch):
    """A published folder under ``BATCHINFER_MODEL_CACHE_DIR`` is served without converting again."""
    published = tmp_path / BUILTIN_MODEL
    published.mkdir()
    (published / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        assert prepare_model() == published
    finally:
        get_settings.cache_clear()
