"""Building and loading the C++ kernels (kernels/cpu_extension.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kernels import cpu_extension

_LOAD = "from kernels.cpu_extension import load_cpu_kernels; print(load_cpu_kernels())"


def test_a_baton_left_by_a_killed_builder_does_not_block_the_next_process(cpu_kernels, tmp_path: Path) -> None:
    """torch's ``lock`` file left behind by a builder killed mid-build (an OOM kill): the next process takes the
    build over and loads the library instead of waiting on it forever."""
    name = f"batchinfer_cpu_{cpu_extension.build_tag()}"
    built = cpu_extension.build_directory(name) / f"{name}.so"
    left = tmp_path / name
    left.mkdir()
    shutil.copy(built, left / built.name)  # the library is there; only the dead builder's baton is in the way
    (left / "lock").touch()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _LOAD], check=False, cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "True", result.stderr
    assert not (left / "lock").exists()
