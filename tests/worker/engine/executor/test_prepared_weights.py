"""The prepared-weights cache: a second load memory-maps the first one's packed model, bit for bit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from kernels.cpu_extension import cpu_kernels_available
from tests.helpers.tiny_llama import save_tiny_llama
from worker.engine.executor.layers.linear import PackedLinear
from worker.engine.executor.model_loader import load_model

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="needs the C++ CPU kernels")


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def test_second_load_maps_the_cached_packed_model(tmp_path):
    path = save_tiny_llama(tmp_path / "model")
    prepared = tmp_path / "prepared"

    fresh = load_model(path, torch.float32, "cpu", prepared_dir=prepared)
    (cache,) = prepared.glob("*.safetensors")
    cached = load_model(path, torch.float32, "cpu", prepared_dir=prepared)

    assert [type(m) for m in cached.modules()] == [type(m) for m in fresh.modules()]
    assert any(isinstance(m, PackedLinear) for m in cached.modules())
    expected, got = _tensors(fresh), _tensors(cached)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
        assert not got[name].requires_grad
    x = torch.randn(3, fresh.config.hidden_size)
    assert torch.equal(cached.compute_logits(x), fresh.compute_logits(x))
    assert list(prepared.glob("*.safetensors")) == [cache]


def test_a_cached_load_imports_no_compiler(tmp_path):
    """Building the module tree on the meta device initialises nothing (torch._dynamo, which a meta normal_
    imports, costs every warm worker start about half a CPU-second)."""
    path = save_tiny_llama(tmp_path / "model")
    prepared = tmp_path / "prepared"
    load_model(path, torch.float32, "cpu", prepared_dir=prepared)
    code = (
        "import sys, torch; from worker.engine.executor.model_loader import load_model; "
        f"load_model({str(path)!r}, torch.float32, 'cpu', prepared_dir={str(prepared)!r}); "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False"


def test_unreadable_cache_is_replaced(tmp_path, caplog):
    path = save_tiny_llama(tmp_path / "model")
    prepared = tmp_path / "prepared"
    fresh = load_model(path, torch.float32, "cpu", prepared_dir=prepared)
    (cache,) = prepared.glob("*.safetensors")
    cache.write_bytes(b"not a safetensors file")

    reloaded = load_model(path, torch.float32, "cpu", prepared_dir=prepared)

    assert "did not load" in caplog.text
    x = torch.randn(3, fresh.config.hidden_size)
    assert torch.equal(reloaded.compute_logits(x), fresh.compute_logits(x))
    assert cache.stat().st_size > 1000  # written again


def test_other_dtypes_and_quantization_are_not_cached(tmp_path):
    path = save_tiny_llama(tmp_path / "model")
    prepared = tmp_path / "prepared"
    load_model(path, torch.bfloat16, "cpu", prepared_dir=prepared)
    load_model(path, torch.float32, "cpu", quantization="int8", prepared_dir=prepared)
    assert not list(prepared.glob("*.safetensors"))  # (the resolved config is: worker/engine/model_files.py)


def test_a_changed_checkpoint_replaces_its_stale_file_and_keeps_other_models(tmp_path):
    prepared = tmp_path / "prepared"
    path, other = save_tiny_llama(tmp_path / "model"), save_tiny_llama(tmp_path / "other")
    load_model(other, torch.float32, "cpu", prepared_dir=prepared)
    (other_cache,) = prepared.glob("*.safetensors")
    load_model(path, torch.float32, "cpu", prepared_dir=prepared)
    (stale,) = set(prepared.glob("*.safetensors")) - {other_cache}

    config = path / "config.json"
    config.write_text(config.read_text() + "\n")  # a new checkpoint: a new digest
    load_model(path, torch.float32, "cpu", prepared_dir=prepared)

    files = set(prepared.glob("*.safetensors"))
    assert other_cache in files and stale not in files and len(files) == 2
