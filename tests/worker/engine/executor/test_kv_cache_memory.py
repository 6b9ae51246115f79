"""The KV cache's memory on CPU (worker/engine/executor/model_runner.py, `zeros_on_first_touch`, `populate`): zeros
that cost nothing until touched, and faulted in as a whole where a worker asks (docs/engine.md, "KV cache memory")."""

from __future__ import annotations

import ctypes
import errno
import gc
import os
from pathlib import Path

import pytest
import torch

from worker.engine.executor import model_runner
from worker.engine.executor.model_runner import populate, zeros_on_first_touch

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


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_populate_makes_every_page_resident_and_keeps_the_values():
    num_bytes = 64 << 20
    cache = zeros_on_first_touch((2, num_bytes // 8), torch.float32, CPU)
    cache[1, 5] = 3.0  # one page already touched, with a value that must survive
    before = _resident_bytes()
    populate(cache)
    assert _resident_bytes() - before > num_bytes * 9 // 10
    assert float(cache[1, 5]) == 3.0 and float(cache.sum()) == 3.0


def test_populate_an_unaligned_view_keeps_its_values_and_its_neighbours():
    cache = torch.arange(3 << 12, dtype=torch.float32)
    view = cache[1000:9000]  # starts and ends inside pages
    populate(view)
    assert torch.equal(cache, torch.arange(3 << 12, dtype=torch.float32))
    populate(cache[:0])  # nothing to do


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_populate_writes_the_pages_where_the_kernel_refuses_madvise(monkeypatch):
    class OldKernel:  # before Linux 5.14: MADV_POPULATE_WRITE is EINVAL
        @staticmethod
        def madvise(*args):
            ctypes.set_errno(errno.EINVAL)
            return -1

    monkeypatch.setattr(model_runner, "_libc", OldKernel)
    num_bytes = 64 << 20
    cache = zeros_on_first_touch((num_bytes // 4,), torch.float32, CPU)
    cache[7] = 2.0
    before = _resident_bytes()
    populate(cache)
    assert _resident_bytes() - before > num_bytes * 9 // 10
    assert float(cache[7]) == 2.0 and float(cache.sum()) == 2.0


def test_populate_raises_where_the_kernel_cannot_back_the_pages(monkeypatch):
    class OutOfMemory:
        @staticmethod
        def madvise(*args):
            ctypes.set_errno(errno.ENOMEM)
            return -1

    monkeypatch.setattr(model_runner, "_libc", OutOfMemory)
    with pytest.raises(OSError, match=r"faulting in \d+ bytes of KV cache") as excinfo:
        populate(zeros_on_first_touch((1 << 20,), torch.float32, CPU))
    assert excinfo.value.errno == errno.ENOMEM
