from pathlib import Path

import pytest

from jobs.config import Settings
from worker.bootstrap import engine_config, num_torch_threads, resolve_device


def test_auto_device_is_cuda_only_when_visible():
    import torch

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("cuda:1") == "cuda:1"


def test_torch_threads_from_settings_or_cores(tmp_path):
    assert num_torch_threads(Settings(data_dir=tmp_path, torch_num_threads=3)) == 3
    assert num_torch_threads(Settings(data_dir=tmp_path, torch_num_threads=None)) >= 1


def test_engine_config_follows_settings(tmp_path, served_model_dir):
    settings = Settings(
        data_dir=tmp_path,
        model=str(served_model_dir),
        device="cpu",
        kv_cache_memory_bytes=1 << 24,
        max_num_seqs=7,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        kv_cache_dtype="fp8",
    )
    config = engine_config(settings)
    assert Path(config.model) == served_model_dir
    assert (config.device, config.dtype) == ("cpu", "float32")
    assert (config.kv_cache_memory_bytes, config.max_num_seqs, config.max_num_batched_tokens) == (1 << 24, 7, 512)
    assert config.enable_prefix_caching is False
    assert config.kv_cache_dtype == "fp8_e4m3"  # vLLM's alias, canonical in the engine


def test_a_model_list_entrys_kv_cache_dtype_and_quantization_reach_its_workers_engine(tmp_path, served_model_dir):
    models = [
        {"name": "plain", "source": str(served_model_dir)},
        {"name": "small-cache", "source": str(served_model_dir), "kv_cache_dtype": "fp8", "quantization": "int8"},
    ]
    configs = {
        name: engine_config(Settings(data_dir=tmp_path, device="cpu", models=models, worker_model=name))
        for name in ("plain", "small-cache")
    }
    assert {name: (c.kv_cache_dtype, c.quantization) for name, c in configs.items()} == {
        "plain": ("auto", "none"),
        "small-cache": ("fp8_e4m3", "int8"),
    }


def test_the_settings_serve_the_engines_kv_cache_dtypes():
    """jobs/ cannot import the engine, so it keeps its own list of names: the same as the engine's."""
    from jobs import config
    from worker.engine.executor.layers.attention import kv_cache

    assert (config.KV_CACHE_DTYPES, config.KV_CACHE_DTYPE_ALIASES) == (
        kv_cache.KV_CACHE_DTYPES,
        kv_cache.KV_CACHE_DTYPE_ALIASES,
    )


def test_an_unknown_kv_cache_dtype_is_refused_by_the_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_KV_CACHE_DTYPE", "int2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        Settings(data_dir=tmp_path)
    monkeypatch.setenv("BATCHINFER_KV_CACHE_DTYPE", "int8")
    assert Settings(data_dir=tmp_path).kv_cache_dtype == "int8"


def test_engine_config_rejects_an_unknown_model(tmp_path):
    from worker.model_prepare import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        engine_config(Settings(data_dir=tmp_path, model=str(tmp_path / "no-such-model")))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tests.helpers.tiny_llama import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_warm_up_generates_and_leaves_a_fresh_stats_window(tiny_model_dir, monkeypatch):
    from worker import bootstrap
    from worker.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory_bytes=1 << 22))
    generated = []
    real_generate = engine.generate

    def recording_generate(prompts, params):
        outputs = real_generate(prompts, params)
        generated.extend(outputs)
        return outputs

    monkeypatch.setattr(engine, "generate", recording_generate)
    populated = []
    monkeypatch.setattr(engine.model_runner, "populate_kv_cache", lambda: populated.append(not generated))
    bootstrap.warm_up_engine(engine)
    assert populated == [True]  # the whole KV cache faulted in, before the warm-up's steps
    assert [len(o.prompt_token_ids) for o in generated] == list(bootstrap.WARMUP_PROMPT_LENS)
    assert [len(o.outputs[0].token_ids) for o in generated] == [bootstrap.WARMUP_MAX_TOKENS] * 2
    assert not engine.has_unfinished_requests()
    stats = engine.make_stats()
    assert (stats.num_steps, stats.num_generation_tokens, stats.num_prompt_tokens_computed) == (0, 0, 0)


def test_get_engine_starts_a_warm_engine(tiny_model_dir, tmp_path, monkeypatch, caplog):
    import logging

    from jobs.config import get_settings
    from kernels.cpu_extension import cpu_kernels_available
    from worker import bootstrap

    for name, value in {
        "BATCHINFER_DATA_DIR": str(tmp_path),
        "BATCHINFER_MODEL": str(tiny_model_dir),
        "BATCHINFER_DEVICE": "cpu",
        "BATCHINFER_KV_CACHE_MEMORY_BYTES": str(1 << 22),
        "BATCHINFER_TORCH_NUM_THREADS": "1",
        "BATCHINFER_MODEL_CACHE_DIR": str(tmp_path / "models"),
    }.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    monkeypatch.setattr(bootstrap, "_engine", None)
    try:
        with caplog.at_level(logging.INFO, logger="worker.bootstrap"):
            engine = bootstrap.get_engine()
        assert any("warmed up" in record.getMessage() for record in caplog.records)
        assert bootstrap.get_engine() is engine
        assert engine.make_stats().num_steps == 0
        if engine.config.prepared_weights_dir is not None and cpu_kernels_available():
            assert list((tmp_path / "models" / "prepared").glob("*.safetensors"))  # the next start maps them
    finally:
        get_settings.cache_clear()


def test_get_engine_embeds_with_a_decoder_the_model_list_marks_embed(tiny_model_dir, tmp_path, monkeypatch):
    # docs/operations.md, "Several models": kind `embed` on a decoder folder is a decoder embedder (last-token
    # pooling), served by the pooling engine; the same folder as kind `generate` stays a generating engine.
    import json

    from jobs.config import get_settings
    from worker import bootstrap
    from worker.engine.pooling_engine import PoolingEngine

    models = {"gen": str(tiny_model_dir), "emb": {"source": str(tiny_model_dir), "kind": "embed"}}
    for name, value in {
        "BATCHINFER_DATA_DIR": str(tmp_path),
        "BATCHINFER_MODELS": json.dumps(models),
        "BATCHINFER_WORKER_MODEL": "emb",
        "BATCHINFER_DEVICE": "cpu",
        "BATCHINFER_TORCH_NUM_THREADS": "1",
        "BATCHINFER_MODEL_CACHE_DIR": str(tmp_path / "models"),
    }.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    monkeypatch.setattr(bootstrap, "_engine", None)
    try:
        engine = bootstrap.get_engine()
        assert isinstance(engine, PoolingEngine) and not engine.is_encoder
        assert engine.pooling.pooling_type == "last"
    finally:
        get_settings.cache_clear()
