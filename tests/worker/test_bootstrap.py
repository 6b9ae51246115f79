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
    )
    config = engine_config(settings)
    assert Path(config.model) == served_model_dir
    assert (config.device, config.dtype) == ("cpu", "float32")
    assert (config.kv_cache_memory_bytes, config.max_num_seqs, config.max_num_batched_tokens) == (1 << 24, 7, 512)
    assert config.enable_prefix_caching is False


def test_engine_config_rejects_an_unknown_model(tmp_path):
    from worker.model_prepare import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        engine_config(Settings(data_dir=tmp_path, model=str(tmp_path / "no-such-model")))
