"""``scripts/gpu_check.sh`` exits non-zero on a kernel mismatch: its kernel-parity step, run in Triton's
interpreter (``--interpret``, no GPU) on one tiny test, fails when the kernel's output is perturbed
(``BATCHINFER_INJECT_KERNEL_FAULT=1``) and passes otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.7.1, the `test` extra)")

ROOT = Path(__file__).resolve().parents[1]
# One decode batch, block size 8, float32 (dtype0): a few seconds in the interpreter.
SELECT = "test_paged_attention_matches_twin and decode-8-dtype0"


def _gpu_check(inject_fault: bool) -> tuple[int, list[dict]]:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "BATCHINFER_GPU_CHECK_SELECT": SELECT,
        "BATCHINFER_INJECT_KERNEL_FAULT": "1" if inject_fault else "0",
    }
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--interpret"],
        check=False,  # the exit status is what the tests assert
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result.returncode, lines


@pytest.mark.slow
def test_gpu_check_exits_non_zero_on_a_wrong_kernel_result():
    rc, lines = _gpu_check(inject_fault=True)

    assert rc != 0
    # pytest's exit status 1: tests ran and failed (not 5, nothing selected, or 4, a usage error).
    assert lines[0]["check"] == "kernels" and lines[0]["ok"] is False and lines[0]["rc"] == 1
    assert lines[-1] == {"check": "summary", "ok": False}


@pytest.mark.slow
def test_gpu_check_passes_the_same_selection_without_the_fault():
    rc, lines = _gpu_check(inject_fault=False)

    assert rc == 0, lines
    assert lines[0]["check"] == "kernels" and lines[0]["ok"] is True
    assert lines[-1] == {"check": "summary", "ok": True}
