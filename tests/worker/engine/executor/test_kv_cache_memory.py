"""The KV cache's memory on CPU (worker/engine/executor/model_runner.py, `zeros_on_first_touch`): zeros that cost
nothing until touched, so a worker start does not write its whole KV budget."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from worker.engine.executor.model_runner import zeros_on_first_touch

CPU = torch.device("cpu")


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zeros_of_the_shape_and_dtype_asked(dtype):
    shape = (2, 5, 8, 2, 16)
    cache = zeros_on_first_touch(shape, dtype, CPU)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert torch.equal(cache, torch.zeros(shape, dtype=dtype))
    assert cache.data_ptr() % 64 == 0  # page-aligned: any vector width the kernels load


def test_writes_last_as_long_as_the_tensor():
    caches = [zeros_on_first_touch((1 << 18,), torch.float32, CPU) for _ in range(3)]
    gc.collect()  # nothing but the tensors holds the mappings
    for value, cache in enumerate(caches, start=1):
        cache.fill_(float(value))
    assert [float(cache.sum()) for cache in caches] == [float(v * (1 << 18)) for v in (1, 2, 3)]
    assert zeros_on_first_touch((0, 4), torch.float32, CPU).shape == (0, 4)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_untouched_pages_are_not_resident():
    num_bytes = 256 << 20
    before = _resident_bytes()
    cache = zeros_on_first_touch((2, num_bytes // 8), torch.float32, CPU)
    assert _resident_bytes() - before < num_bytes // 8
    cache[0, : 1 << 20].fill_(1.0)  # 4 MiB touched
    assert float(cache[0, : 1 << 20].sum()) == float(1 << 20)
    assert _resident_bytes() - before < num_bytes // 4
