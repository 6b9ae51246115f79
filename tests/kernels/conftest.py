"""Fixtures for the C++ CPU kernel tests."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_extension


@pytest.fixture
def cpu_kernels(monkeypatch):
    """One torch thread and the C++ kernels built and enabled (skip where no C++ compiler is on PATH)."""
    torch.set_num_threads(1)
    monkeypatch.delenv(cpu_extension.DISABLE_ENV, raising=False)
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: the kernels cannot be built here")
    assert cpu_extension.cpu_kernels_available(), (
        "a C++ compiler is present but the kernels failed to build (see the log)"
    )
