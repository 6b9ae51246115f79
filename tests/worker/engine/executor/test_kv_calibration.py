"""Key smoothing of the quantized KV cache (executor/kv_calibration.py; docs/engine.md, "Quantized KV cache")."""

from __future__ import annotations

import pytest
import torch
import transformers

from kernels.reference import dequantize_kv, quantize_kv
from tests.helpers.tiny_llama import save_tiny_llama
from worker.engine import EngineConfig, LLMEngine
from worker.engine.executor.kv_calibration import smoothing_from_key_absmax
from worker.engine.executor.layers.attention import QuantizedKVCache


def test_smoothing_leaves_every_query_key_product_unchanged():
    generator = torch.Generator().manual_seed(0)
    smoothing = torch.rand(2, 16, generator=generator) * 5 + 0.1
    cache = QuantizedKVCache.zeros("int8", 4, 8, 2, 16, torch.device("cpu"), key_smoothing=smoothing)
    query, key = torch.randn(5, 4, 16, generator=generator), torch.randn(5, 2, 16, generator=generator)

    smoothed_query, smoothed_key = cache.smooth(query, key)

    # query heads 0, 1 read KV head 0; heads 2, 3 read KV head 1 (GQA)
    expected = torch.einsum("qhd,khd->hqk", query, key.repeat_interleave(2, dim=1))
    actual = torch.einsum("qhd,khd->hqk", smoothed_query, smoothed_key.repeat_interleave(2, dim=1))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(smoothed_key, key)


def test_bad_smoothing_is_refused():
    with pytest.raises(ValueError, match="key_smoothing must be positive"):
        QuantizedKVCache.zeros("int8", 4, 8, 2, 16, torch.device("cpu"), key_smoothing=torch.zeros(2, 16))
    with pytest.raises(ValueError, match="key_smoothing must be positive"):
        QuantizedKVCache.zeros("int8", 4, 8, 2, 16, torch.device("cpu"), key_smoothing=torch.ones(16))


def test_without_smoothing_query_and_key_pass_through():
    cache = QuantizedKVCache.zeros("fp8_e4m3", 4, 8, 2, 16, torch.device("cpu"))
    query, key = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    smoothed_query, smoothed_key = cache.smooth(query, key)
    assert smoothed_query is query and smoothed_key is key


def test_smoothing_factors_are_the_root_of_each_channels_range_floored_and_normalised():
    absmax = torch.tensor([[1.0, 4.0, 100.0, 0.0], [0.0, 0.0, 0.0, 0.0]])

    smoothing = smoothing_from_key_absmax(absmax)

    # sqrt(1), sqrt(4), sqrt(100), and the silent channel floored at 1% of 100 -> sqrt(1)
    root = torch.tensor([1.0, 2.0, 10.0, 1.0])
    torch.testing.assert_close(smoothing[0], root / root.mean())
    torch.testing.assert_close(smoothing[1], torch.ones(4))  # nothing measured: keys stored as they are


def test_smoothed_int8_keys_score_closer_when_keys_have_outlier_channels():
    """Per-token int8 of keys whose channels 3 and 11 are 30x the rest: smoothing with their range cuts the
    error of ``q . k`` several times (the reason for smoothing)."""
    generator = torch.Generator().manual_seed(0)
    channel_range = torch.ones(16)
    channel_range[[3, 11]] = 30.0
    keys = torch.randn(256, 1, 16, generator=generator) * channel_range
    queries = torch.randn(64, 1, 16, generator=generator)
    smoothing = smoothing_from_key_absmax(keys.abs().amax(dim=0))
    cache = QuantizedKVCache.zeros("int8", 1, 8, 1, 16, torch.device("cpu"), key_smoothing=smoothing)

    def score_error(q: torch.Tensor, k: torch.Tensor) -> float:
        stored = dequantize_kv(*quantize_kv(k, "int8"))
        return float((torch.einsum("qhd,khd->qk", q, stored) - torch.einsum("qhd,khd->qk", q, k)).abs().mean())

    assert score_error(*cache.smooth(queries, keys)) < score_error(queries, keys) / 3


@pytest.fixture(scope="module")
def outlier_model_dir(tmp_path_factory):
    """The tiny Llama with KV head 0's channels 5 and 13 (a RoPE pair) of ``k_proj`` made 20x larger."""
    path = save_tiny_llama(tmp_path_factory.mktemp("outlier_llama"))
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight[[5, 13]] *= 20.0
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_calibration_is_deterministic_and_finds_the_outlier_channels(outlier_model_dir):
    def smoothing_of(kv_cache_dtype: str) -> list[torch.Tensor | None]:
        engine = LLMEngine(EngineConfig(model=str(outlier_model_dir), kv_cache_dtype=kv_cache_dtype))
        caches = engine.model_runner.kv_caches
        assert all(isinstance(cache, QuantizedKVCache) for cache in caches)
        return [cache.key_smoothing for cache in caches if isinstance(cache, QuantizedKVCache)]

    first, again = smoothing_of("int8"), smoothing_of("int8")

    for smoothing, smoothing_again in zip(first, again, strict=True):
        assert smoothing is not None and smoothing.shape == (2, 16)
        assert torch.equal(smoothing, smoothing_again)
        assert set(smoothing[0].topk(2).indices.tolist()) == {5, 13}, smoothing
        assert float(smoothing[0, [5, 13]].min()) > 2.5 * float(smoothing[0].median())
    for int4, int8 in zip(smoothing_of("int4"), first, strict=True):  # int4's calibration runs without kernels
        assert int4 is not None and int8 is not None
        torch.testing.assert_close(int4, int8, rtol=1e-4, atol=0)
    assert smoothing_of("fp8") == [None, None]  # float8 keeps its keys as they are
