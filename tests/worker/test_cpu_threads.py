"""Thread sizing from cgroup quotas and affinity (worker/cpu_threads.py; docs/engine.md, "Threads on shared cores")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cpu_threads import available_cpus, cgroup_cpu_limit, parse_cfs_quota, parse_cpu_max


def test_parse_cpu_max() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("200000 100000\n") == 2.0
    assert parse_cpu_max("50000 100000") == 0.5
    assert parse_cpu_max("150000") == 1.5  # the period defaults to 100 ms
    for bad in ("", "a b", "0 100000", "1 2 3"):
        with pytest.raises(ValueError):
            parse_cpu_max(bad)


def test_parse_cfs_quota() -> None:
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("150000", "100000") == 1.5


def _cgroup_tree(tmp_path: Path, files: dict[str, str], proc_cgroup: str = "0::/\n") -> tuple[Path, Path]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_cgroup)
    return tmp_path, proc


def test_cgroup_limit_v2_own_group_and_root(tmp_path: Path) -> None:
    root, proc = _cgroup_tree(
        tmp_path,
        {"cpu.max": "max 100000\n", "system.slice/worker.service/cpu.max": "100000 100000\n"},
        proc_cgroup="0::/system.slice/worker.service\n",
    )
    assert cgroup_cpu_limit(root, proc) == 1.0
    assert available_cpus(root, proc) == 1


def test_cgroup_limit_v1_and_tightest_wins(tmp_path: Path) -> None:
    root, proc = _cgroup_tree(
        tmp_path,
        {
            "cpu.max": "300000 100000",
            "cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
            "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
        proc_cgroup="4:cpu,cpuacct:/\n",
    )
    assert cgroup_cpu_limit(root, proc) == 0.5
    assert available_cpus(root, proc) == 1  # a fraction of a core rounds up, never to 0


def test_no_quota_or_garbage_means_affinity(tmp_path: Path) -> None:
    root, proc = _cgroup_tree(
        tmp_path, {"cpu.max": "garbage", "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}
    )
    assert cgroup_cpu_limit(root, proc) is None
    assert available_cpus(root, proc) == len(os.sched_getaffinity(0))


def test_affinity_caps_a_larger_quota(tmp_path: Path) -> None:
    root, proc = _cgroup_tree(tmp_path, {"cpu.max": "6400000 100000"})
    assert available_cpus(root, proc) == len(os.sched_getaffinity(0))


def test_affinity_mask_is_honoured() -> None:
    """A worker pinned to one core (taskset) sizes one thread, whatever the machine has."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from worker.cpu_threads import available_cpus; print(available_cpus())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_bounded_wait_set_before_torch_unless_chosen() -> None:
    code = (
        "import os, sys; from worker.cpu_threads import use_bounded_wait; "
        "print(use_bounded_wait(), os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT')); "
        "import torch; print(use_bounded_wait())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def run(extra: dict[str, str]) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**env, **extra}
        )
        return out.stdout.split()

    assert run({}) == ["True", "PASSIVE", "30000", "False"]
    # A policy or a spin count the user chose is kept as it is.
    assert run({"OMP_WAIT_POLICY": "ACTIVE"})[:3] == ["True", "ACTIVE", "None"]
    assert run({"GOMP_SPINCOUNT": "0"})[:3] == ["True", "PASSIVE", "0"]


@pytest.mark.parametrize(
    "start",
    ["from worker import cli\ncli.main(['worker'])\n", "import worker.tasks\n"],
    ids=["batchinfer worker", "celery -A worker.tasks"],
)
def test_worker_start_sets_passive_wait_before_anything_loads_torch(tmp_path: Path, start: str) -> None:
    """``batchinfer worker`` imports torch early (its telemetry and tasks do), and ``celery -A worker.tasks worker``
    starts at the tasks module; the policy must be set by then, or every OpenMP thread of the worker spins
    (seconds of CPU in the warm-up alone on shared cores)."""
    code = (
        "import os, sys\n"
        "class StopAtTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), flush=True)\n"
        "            os._exit(0)\n"
        "sys.meta_path.insert(0, StopAtTorch())\n" + start
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") and not k.startswith("BATCHINFER_")
    }
    env["BATCHINFER_DATA_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["PASSIVE", "30000"]
