"""Run the real API and worker as child processes, the way users start them.

Children get a clean ``BATCHINFER_*`` environment (whatever the test process has is dropped, but for
the model cache, where the built-in model is converted once) and one torch thread.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The test Redis's database of the shared stack (tests/e2e/served/conftest.py); see tests/e2e/conftest.py.
SHARED_STACK_REDIS_DB = 14


def redis_db_url(db: int) -> str:
    """Database ``db`` of the test Redis (``BATCHINFER_TEST_REDIS_URL``)."""
    base = os.environ.get("BATCHINFER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + f"/{db}"


def child_env(**settings: str) -> dict[str, str]:
    """This process's environment without ``BATCHINFER_*``, plus ``settings`` as ``BATCHINFER_<NAME>``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_") or k == "BATCHINFER_MODEL_CACHE_DIR"}
    env.update({f"BATCHINFER_{k.upper()}": v for k, v in settings.items()})
    env.setdefault("BATCHINFER_TORCH_NUM_THREADS", "1")
    env["OMP_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "worker.cli", *args]


@contextmanager
def running(command: list[str], env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen]:
    """Run ``command`` for the block; on exit `interrupt` it (SIGINT, as Ctrl-C would; killed after 30 s)."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            interrupt([process])


def interrupt(processes: Iterable[subprocess.Popen], timeout_s: float = 30) -> None:
    """SIGINT each of ``processes`` still running, all at once, then wait for them; kill any still running
    ``timeout_s`` after the signal.

    NOTE: a stack's processes stopped together, not one after another as nested ``running`` blocks
    would, wait out their shutdowns (seconds for a Celery worker on a busy machine) side by side. One
    SIGINT each: a second one is a Celery worker's cold shutdown.
    """
    live = [process for process in processes if process.poll() is None]
    for process in live:
        process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for process in live:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def child_processes(pid: int) -> dict[int, list[str]]:
    """The live (not yet exited) children of process ``pid``, pid -> argv, read from Linux's /proc."""
    children = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat_path.read_text().rsplit(")", 1)[1].split()[:2]
            argv = (stat_path.parent / "cmdline").read_bytes().split(b"\0")[:-1]
        except (OSError, IndexError, ValueError):
            continue  # exited while being read
        if int(ppid) == pid and state != "Z":
            children[int(stat_path.parent.name)] = [arg.decode() for arg in argv]
    return children


def wait_for_health(base_url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the API exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the API did not answer /health within {timeout_s} s:\n{log_path.read_text()[-4000:]}")


def wait_for_batch(client, batch_id: str, timeout_s: float, logs: list[Path]):
    """Poll with the openai SDK until the batch is terminal; fails with the service logs on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        time.sleep(1)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in logs if p.exists())
    pytest.fail(f"batch {batch_id} still {batch.status} after {timeout_s} s\n{tails}")


@contextmanager
def redis_server(port: int, data_dir: Path) -> Iterator[subprocess.Popen]:
    """A throwaway ``redis-server`` on ``port`` (no persistence) for the block."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    data_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=data_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=20)
