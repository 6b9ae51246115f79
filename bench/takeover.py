"""Worker start and takeover after a kill, with real processes (the worker half of ``bench/api.py``).

Runs on a database and a Redis broker given by the caller (``bench/api.py`` makes a fresh PostgreSQL
database), with the real model (SmolLM2) and the default lease, heartbeat and reaper settings.

1. **worker_ready_s**: ``batchinfer worker`` is started ``num_starts`` + 1 times, one after another;
   each time, the seconds from ``Popen`` to its ``workers`` row saying ready (``ready_s`` set: engine
   loaded and warmed up, Celery consuming). The first start is not counted (it may convert the model
   or build the C++ kernels): the figure is the median of the warm starts on a machine that has run
   the worker before. ``worker_self_ready_s`` is the median of what the workers wrote themselves
   (from their process's start, so nearly the same); ``worker_ready_cpu_s`` the median CPU seconds
   (user + system, all threads) a worker used until ready: unlike the wall figures it hardly depends on
   what else the machine runs.
2. **resume_after_kill_s**: the API, beat (the reaper) and two workers; one batch of ``lines`` short
   completion lines (one shard), the workers running ``max_num_seqs`` lines at a time (16, the runner's
   commit group: so the figure measures the takeover, not a first wave of 256 lines through a loaded
   CPU). Once the shard has stored some results, the worker holding it is SIGKILLed; the figure is the
   seconds from the kill to the next result of that shard stored by the other worker (a killed
   worker's lease is reclaimed when its heartbeat is ``worker_dead_s`` old, by the extra reaper pass
   scheduled for that moment; the shard's message is sent in the same pass, and the idle worker
   claims it at once). ``reclaimed_after_kill_s`` is
   when the shard was seen back in the hands of the other worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
CLI = [sys.executable, "-m", "worker.cli"]
START_TIMEOUT_S = 900.0


def _ready_row(conn: psycopg.Connection, pid: int) -> float | None:
    row = conn.execute(
        "SELECT ready_s FROM workers WHERE host = %s AND pid = %s", (socket.gethostname(), pid)
    ).fetchone()
    return None if row is None else row[0]


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``batchinfer COMMAND`` leading a process group of its own (beat starts a scheduler process)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [*CLI, *command], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )


def _start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return _spawn(["worker"], env, log)


def _wait_ready(conn: psycopg.Connection, worker: subprocess.Popen[bytes], log: Path) -> float:
    """Poll the worker's row until it says ready; returns the worker's own ``ready_s``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while (ready_s := _ready_row(conn, worker.pid)) is None:
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker {worker.pid} did not become ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return float(ready_s)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process's group (a warm shutdown), SIGKILL what is left after 60 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def worker_ready_times(env: dict[str, str], database_dsn: str, logs: Path, num_starts: int = 3) -> dict[str, Any]:
    """Start a worker ``num_starts + 1`` times (the first not counted); see the module docstring."""
    outside, own, cpu = [], [], []
    with psycopg.connect(database_dsn, autocommit=True) as conn:
        for i in range(num_starts + 1):
            log = logs / f"start{i}.log"
            start = time.monotonic()
            worker = _start_worker(env, log)
            try:
                ready_s = _wait_ready(conn, worker, log)
                elapsed_s = time.monotonic() - start
                cpu_s = _cpu_s(worker.pid)
            finally:
                _stop(worker)
            if i:
                outside.append(elapsed_s)
                own.append(ready_s)
                cpu.append(cpu_s)
    return {
        "worker_ready_s": round(statistics.median(outside), 2),
        "worker_ready_runs_s": [round(s, 2) for s in outside],
        "worker_self_ready_s": round(statistics.median(own), 2),
        "worker_ready_cpu_s": round(statistics.median(cpu), 2),
    }


def _lines(num_lines: int) -> bytes:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"Item {i}: the batch API in a few words is", "max_tokens": 8},
        }
        for i in range(num_lines)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _shard(conn: psycopg.Connection, batch_id: str) -> tuple[str, str | None, int]:
    """``(shard_id, lease_owner, results stored)`` of the batch's (single) shard."""
    shard = conn.execute(
        "SELECT id, lease_owner FROM batch_shards WHERE batch_id = %s ORDER BY shard_index LIMIT 1", (batch_id,)
    ).fetchone()
    assert shard is not None, "the batch has no shard"
    shard_id, owner = shard
    count = conn.execute(
        "SELECT count(*) FROM batch_requests WHERE shard_id = %s AND state <> 'pending'", (shard_id,)
    ).fetchone()
    num_done = 0 if count is None else count[0]
    return shard_id, owner, int(num_done)


def resume_after_kill(
    env: dict[str, str],
    database_dsn: str,
    logs: Path,
    base_url: str,
    num_lines: int = 1500,
    max_num_seqs: int = 16,
) -> dict[str, Any]:
    """Two workers, one shard, the holder SIGKILLed mid-shard; see the module docstring. The API and beat
    must already run (``base_url``)."""
    worker_env = dict(env, BATCHINFER_MAX_NUM_SEQS=str(max_num_seqs))
    workers = [_start_worker(worker_env, logs / f"worker{i}.log") for i in range(2)]
    try:
        with psycopg.connect(database_dsn, autocommit=True) as conn:
            for i, worker in enumerate(workers):
                _wait_ready(conn, worker, logs / f"worker{i}.log")
            created = httpx.post(
                f"{base_url}/v1/jobs",
                files={"file": ("takeover.jsonl", _lines(num_lines))},
                data={"endpoint": "/v1/completions"},
                timeout=120,
            )
            created.raise_for_status()
            batch_id = created.json()["id"]
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:  # until the shard has stored some results (it is mid-run)
                status = httpx.get(f"{base_url}/v1/batches/{batch_id}", timeout=30).json()
                if status["status"] not in ("validating", "in_progress") or time.monotonic() > deadline:
                    raise RuntimeError(f"the batch ended before the kill: {status['status']}")
                if status["status"] == "in_progress":
                    _, owner, num_done = _shard(conn, batch_id)
                    if owner is not None and 0 < num_done < num_lines // 2:
                        break
                    if num_done >= num_lines // 2:
                        raise RuntimeError("the shard ran half its lines before the kill; give more --takeover-lines")
                time.sleep(0.1)
            victim = next(w for w in workers if owner == f"{socket.gethostname()}:{w.pid}")
            victim.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            victim.wait()
            time.sleep(0.5)  # NOTE: a commit the victim sent just before its death may still land
            _, _, done_at_kill = _shard(conn, batch_id)
            reclaimed_s = None
            while True:
                _, now_owner, num_done = _shard(conn, batch_id)
                if reclaimed_s is None and now_owner is not None and now_owner != owner:
                    reclaimed_s = time.monotonic() - killed
                if num_done > done_at_kill:
                    resumed_s = time.monotonic() - killed
                    break
                if time.monotonic() - killed > START_TIMEOUT_S:
                    raise RuntimeError("no result after the kill")
                time.sleep(0.1)
    finally:
        for worker in workers:
            _stop(worker)
    return {
        "resume_after_kill_s": round(resumed_s, 2),
        "reclaimed_after_kill_s": None if reclaimed_s is None else round(reclaimed_s, 2),
        "takeover_lines": num_lines,
        "takeover_max_num_seqs": max_num_seqs,
        "takeover_done_at_kill": done_at_kill,
    }


def start_api_and_beat(env: dict[str, str], logs: Path) -> tuple[list[subprocess.Popen[bytes]], str]:
    """The API (on a free port) and beat, for `resume_after_kill`; returns them and the API's base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = [
        _spawn(["api", "--host", "127.0.0.1", "--port", str(port)], env, logs / "api.log"),
        _spawn(["beat"], env, logs / "beat.log"),
    ]
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return processes, base_url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the API did not come up")
        time.sleep(0.3)


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        _stop(process)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)
