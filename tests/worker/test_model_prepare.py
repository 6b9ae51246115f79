import json

import numpy as np
import pytest

from jobs.config import BUILTIN_MODEL, get_settings
from worker.model_prepare import (
    ModelNotFoundError,
    check_model,
    prepare_model,
    unpermute_rope_rows,
)


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter layout: each head's two rotary halves interleaved row by row."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(num_heads):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((num_heads * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(_llama_cpp_permute(weight, num_heads), num_heads), weight)
    assert not np.array_equal(_llama_cpp_permute(weight, num_heads), weight)


def test_local_folder_is_served_as_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert prepare_model(str(tmp_path)) == tmp_path.resolve()


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither"):
        prepare_model(str(tmp_path / "missing"))


@pytest.mark.slow
def test_builtin_model_converts_and_answers():
    model_dir = prepare_model(BUILTIN_MODEL)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True
    check_model(model_dir)


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
