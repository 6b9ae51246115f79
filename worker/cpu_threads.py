"""How many kernel threads a worker runs, and how they wait, when the CPU cores are shared.

A worker's GEMM and attention kernels split each call across torch's intra-op threads (OpenMP), and every
call ends at a barrier. With more threads than the cores the process is really given (a cgroup CPU quota, a
CPU affinity mask), or with libgomp's default active wait (threads spin at the barrier for about 300,000
iterations before sleeping), a thread that finished its share burns the time slice the late thread needed,
and a 2-core machine loaded by other processes ran the engine about 7x slower (issue #27; docs/engine.md,
"Threads on shared cores"). So the worker sizes its threads to :func:`available_cpus` and sets
``OMP_WAIT_POLICY=PASSIVE`` with a bounded spin (:func:`use_bounded_wait`) before torch, and with it libgomp, is first imported.

Sources: Linux cgroup v2 ``cpu.max`` ("``$MAX $PERIOD``", ``max`` when unlimited) and v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us`` (-1 when unlimited), kernel docs
(admin-guide/cgroup-v2.rst, scheduler/sched-bwc.rst); libgomp's ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT``
(GCC's libgomp manual).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
BOUNDED_SPIN_COUNT = "30000"


def parse_cpu_max(text: str) -> float | None:
    """Cores allowed by a cgroup v2 ``cpu.max`` line (``"200000 100000"`` -> 2.0); None when unlimited.

    Raises:
        ValueError: on a line that is not ``"max|QUOTA [PERIOD]"`` with positive integers.
    """
    fields = text.split()
    if not 1 <= len(fields) <= 2:
        raise ValueError(f"cpu.max: expected 'QUOTA PERIOD', got {text!r}")
    if fields[0] == "max":
        return None
    quota_us, period_us = int(fields[0]), int(fields[1]) if len(fields) == 2 else 100_000
    if quota_us <= 0 or period_us <= 0:
        raise ValueError(f"cpu.max: quota and period must be positive, got {text!r}")
    return quota_us / period_us


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """Cores allowed by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None when the quota is -1."""
    quota_us, period_us = int(quota_text), int(period_text)
    if quota_us < 0 or period_us <= 0:
        return None
    return quota_us / period_us


def _cgroup_v2_path(proc_cgroup_text: str) -> str | None:
    """The unified hierarchy's path from ``/proc/self/cgroup`` (its ``0::/path`` line), or None."""
    for line in proc_cgroup_text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """Cores this process's cgroup may use per period (a fraction when the quota is one), or None: no quota.

    Looks at the process's own cgroup v2 directory, then the root ``cpu.max`` (a container sees its own
    cgroup there), then cgroup v1's ``cpu``/``cpu,cpuacct`` controllers. The tightest quota found wins.
    Unreadable or malformed files count as no quota.
    """
    candidates: list[Path] = []
    try:
        v2_path = _cgroup_v2_path(proc_cgroup.read_text())
    except OSError:
        v2_path = None
    if v2_path and v2_path != "/":
        candidates.append(root / v2_path.lstrip("/") / "cpu.max")
    candidates.append(root / "cpu.max")
    limits: list[float] = []
    for path in candidates:
        try:
            limit = parse_cpu_max(path.read_text())
        except (OSError, ValueError):
            continue
        if limit is not None:
            limits.append(limit)
    for controller in ("cpu", "cpu,cpuacct"):
        try:
            limit = parse_cfs_quota(
                (root / controller / "cpu.cfs_quota_us").read_text(),
                (root / controller / "cpu.cfs_period_us").read_text(),
            )
        except (OSError, ValueError):
            continue
        if limit is not None:
            limits.append(limit)
    return min(limits, default=None)


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> int:
    """Cores the process is given: its CPU affinity, capped by the cgroup quota rounded up; at least 1."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        affinity = min(affinity, math.ceil(limit))
    return max(1, affinity)


def use_bounded_wait() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` with a bounded spin, ``GOMP_SPINCOUNT`` :data:`BOUNDED_SPIN_COUNT`, unless
    the user chose a policy or a spin count; True when it takes effect here.

    A thread that reaches a barrier first spins about 0.3 ms (libgomp counts ~100,000 spins a millisecond)
    before it sleeps on a futex: long enough to bridge the gap between a decode step's consecutive parallel
    regions (a futex wake-up per region cost batch-1 q4 decode a third of its speed), short enough that a
    descheduled partner costs little (docs/engine.md, "Threads on shared cores"). libgomp reads both variables
    once, when it is loaded (with torch's first import): a later call only changes them for child processes,
    and returns False.
    """
    if WAIT_POLICY_ENV not in os.environ:
        os.environ[WAIT_POLICY_ENV] = "PASSIVE"
        os.environ.setdefault(SPIN_COUNT_ENV, BOUNDED_SPIN_COUNT)
    return "torch" not in sys.modules
