"""The sandbox for untrusted grader code (worker/grading/sandbox.py): each escape ends as a clear error.

Small limits and short timeouts keep each case well under a second (the two timeouts excepted).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker.grading import sandbox
from worker.grading.sandbox import SandboxLimits, run_in_sandbox

LIMITS = SandboxLimits(timeout_s=1.5, cpu_s=2, memory_bytes=256 << 20, max_processes=16, max_file_bytes=1 << 20)


def _grade(body: str, **task: object) -> tuple[object, str | None, bool]:
    source = "import os, socket, time\n\ndef grade(sample, item):\n" + body
    result = run_in_sandbox({"kind": "grade", "source": source, "sample": {}, "item": {}, **task}, LIMITS)
    return result.value, result.error, result.stopped


def test_a_grader_runs_and_may_write_in_its_own_folder() -> None:
    body = "    open('mine.txt', 'w').write('x')\n    import tempfile; tempfile.TemporaryFile().write(b'x')\n"
    assert _grade(body + "    return 0.25\n") == (0.25, None, False)


def test_an_exception_is_reported_with_its_line() -> None:
    assert _grade("    return 1 / 0\n") == (None, "raised ZeroDivisionError: division by zero (line 4)", False)


def test_a_socket_is_refused() -> None:
    value, error, stopped = _grade("    socket.create_connection(('192.0.2.1', 80), timeout=1)\n    return 1.0\n")
    assert (value, error, stopped) == (None, "tried network access, which the sandbox refuses", True)


def test_a_refused_socket_that_is_caught_still_has_no_network() -> None:
    # Below the audit hook: the namespace has no route anywhere (or the hook's refusal recurs).
    body = (
        "    try:\n        socket.create_connection(('192.0.2.1', 80), timeout=1)\n    except OSError:\n        pass\n"
    )
    assert _grade(body + "    return 1.0\n")[1:] == ("tried network access, which the sandbox refuses", True)


def test_writing_outside_the_folder_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    value, error, stopped = _grade(f"    open({str(target)!r}, 'w').write('x')\n    return 1.0\n")
    assert (value, error, stopped) == (None, f"tried writing {target}, which the sandbox refuses", True)
    low_level = f"    os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)\n    return 1.0\n"
    assert _grade(low_level)[1] == f"tried writing {target}, which the sandbox refuses"
    assert not target.exists()


def test_a_fork_bomb_hits_the_process_limit() -> None:
    if os.geteuid() != 0:
        pytest.skip("RLIMIT_NPROC counts every process of a non-root user, not only the sandbox's")
    value, error, stopped = _grade("    while True:\n        os.fork()\n")
    assert value is None and stopped
    assert error is not None and error.startswith("hit the process limit of 16 processes")


def test_sleeping_forever_times_out() -> None:
    assert _grade("    time.sleep(1000)\n") == (None, "timed out after 1.5 s", True)


def test_allocating_10_gb_exceeds_the_memory_limit() -> None:
    assert _grade("    x = bytearray(10 * 1024**3)\n    return 1.0\n") == (
        None,
        "exceeded the memory limit of 256 MiB",
        True,
    )


def test_a_grade_that_is_not_a_number_or_exits_is_an_error() -> None:
    assert _grade("    return 'high'\n")[1] == "raised TypeError: grade() returned str, not a number"
    assert _grade("    os._exit(3)\n")[1] == "ended with status 3 without a result"


def _namespaces_available() -> bool:
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return False
    return subprocess.run([unshare, "-n", "-m", "true"], check=False).returncode == 0


@pytest.mark.skipif(not _namespaces_available(), reason="needs root with CAP_SYS_ADMIN (new namespaces)")
def test_as_root_the_code_runs_as_nobody_in_its_own_namespaces() -> None:
    # PID 2 under the namespace's reaper, uid nobody, only a loopback interface, a private /tmp (which shows
    # only the working folder and, when the checkout or virtualenv lies under the host's /tmp, that folder).
    kept = sorted(
        {"work"} | {os.path.realpath(p).split("/")[2] for p in sys.path if os.path.realpath(p).startswith("/tmp/")}
    )
    body = (
        "    interfaces = [line.split(':')[0].strip() for line in open('/proc/self/net/dev').readlines()[2:]]\n"
        "    assert interfaces == ['lo'], interfaces\n"
        f"    assert os.getcwd() == '/tmp/work' and sorted(os.listdir('/tmp')) == {kept!r}, os.listdir('/tmp')\n"
        "    return float(os.getpid() * 100000 + os.getuid())\n"
    )
    assert _grade(body) == (2 * 100000 + 65534, None, False)


def test_without_namespaces_or_a_user_to_drop_to_the_audit_hook_and_timeout_still_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a worker that is not root gets (and the sandbox's last line of defence everywhere).
    monkeypatch.setattr(sandbox, "_unprivileged_ids", lambda: None)
    target = tmp_path / "escaped.txt"
    assert (
        _grade(f"    open({str(target)!r}, 'w')\n    return 1.0\n")[1]
        == f"tried writing {target}, which the sandbox refuses"
    )
    assert _grade("    socket.socket()\n    return 1.0\n")[1] == "tried network access, which the sandbox refuses"
    assert _grade("    time.sleep(1000)\n") == (None, "timed out after 1.5 s", True)
    assert _grade("    return 0.5\n") == (0.5, None, False)
