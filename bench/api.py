"""The service's own costs on PostgreSQL: validating a 50,000-line file, status polls, worker start and takeover.

Runs the real API process (``batchinfer api``, uvicorn, one process) on a fresh PostgreSQL database
(created on the server at ``BATCHINFER_TEST_POSTGRES_URL``, dropped afterwards) with the embedded
broker (no worker runs: the batch stays ``in_progress``, which is what pollers see mid-run).

1. **Validation**: ``POST /v1/jobs`` with a 50,000-line chat file (about 50 MB), then polling until
   the batch leaves ``validating``: ``validation_lines_per_s`` is lines over the seconds from the
   upload's start to ``in_progress`` (upload, storage, both validation passes, inserting the lines);
   ``validation_peak_rss_mb`` is the API process's peak resident set (``VmHWM``, reset before the
   upload) and ``baseline_rss_mb`` its resident set just before.
2. **Polls**: 100 threads, each with its own connection, each ``GET /v1/batches/{id}`` in a loop for
   ``--poll-seconds``; ``poll_p50_ms`` and ``poll_p99_ms`` over every request.

3. **Workers** (`bench/takeover.py`; real model, Redis broker at ``--redis-url``, same database):
   ``worker_ready_s``, the median of 3 warm starts of ``batchinfer worker`` from process start to its
   heartbeat row saying ready (target <= 10 s on a machine that has run it before); and
   ``resume_after_kill_s``, from SIGKILL of the worker holding a shard mid-run, with a second worker
   and beat running, to the next stored result of that shard (target <= 45 s). ``load_average`` is
   the 1-minute load when the script ended: on a busy machine both figures grow with it.

There is no peer for these numbers (no other OpenAI-Batch server runs here); compare runs of this
script. Usage: python bench/api.py [--lines 50000] [--pollers 100] [--poll-seconds 10]
[--redis-url URL] [--skip-api] [--skip-workers]
Prints one JSON object (the last line).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx
import psycopg
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent))
import takeover

ROOT = Path(__file__).resolve().parents[1]
ADMIN_URL = os.environ.get("BATCHINFER_TEST_POSTGRES_URL", "postgresql+psycopg://root@127.0.0.1:5432/postgres")
MODEL = "SmolLM2-135M-Instruct"


def _admin() -> psycopg.Connection:
    url = make_url(ADMIN_URL)
    return psycopg.connect(
        host=url.host, port=url.port or 5432, user=url.username, dbname=url.database or "postgres", autocommit=True
    )


def _input_file(num_lines: int) -> bytes:
    out = io.BytesIO()
    for i in range(num_lines):
        content = f"Question {i}: " + "Explain the batch API in plain words. " * 24
        line = {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16},
        }
        out.write(json.dumps(line).encode() + b"\n")
    return out.getvalue()


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def _wait_for_health(base_url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the API did not come up")


def _poll(base_url: str, batch_id: str, seconds: float, latencies: list[float], lock: threading.Lock) -> None:
    mine = []
    with httpx.Client(base_url=base_url, timeout=30) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            start = time.perf_counter()
            client.get(f"/v1/batches/{batch_id}").raise_for_status()
            mine.append((time.perf_counter() - start) * 1000)
    with lock:
        latencies.extend(mine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--pollers", type=int, default=100)
    parser.add_argument("--poll-seconds", type=float, default=10.0)
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("BATCHINFER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="the broker of the worker measurements (its default queue must be free for this run)",
    )
    parser.add_argument("--takeover-lines", type=int, default=1500)
    parser.add_argument("--skip-api", action="store_true", help="skip the validation and poll measurements")
    parser.add_argument("--skip-workers", action="store_true", help="skip worker_ready_s and resume_after_kill_s")
    args = parser.parse_args()

    name = f"batchinfer_bench_{secrets.token_hex(4)}"
    with _admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    database_url = make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    result: dict[str, object] = {"database": "postgresql"}
    try:
        if not args.skip_api:
            result.update(_api_costs(args, database_url))
        if not args.skip_workers:
            result.update(_worker_costs(args, database_url))
    finally:
        with _admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    result["load_average"] = takeover.load_average()
    print(json.dumps(result))


def _worker_costs(args: argparse.Namespace, database_url: str) -> dict[str, object]:
    url = make_url(database_url)
    dsn = f"host={url.host} port={url.port or 5432} user={url.username} dbname={url.database}"
    with TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
        env.update(
            BATCHINFER_DATA_DIR=tmp,
            BATCHINFER_DATABASE_URL=database_url,
            BATCHINFER_BROKER_URL=args.redis_url,
            PYTHONPATH=str(ROOT),
        )
        subprocess.run([sys.executable, "-m", "worker.cli", "db", "upgrade"], env=env, cwd=ROOT, check=True)
        logs = Path(tmp)
        result: dict[str, object] = dict(takeover.worker_ready_times(env, dsn, logs))
        processes, base_url = takeover.start_api_and_beat(env, logs)
        try:
            result.update(takeover.resume_after_kill(env, dsn, logs, base_url, num_lines=args.takeover_lines))
        finally:
            takeover.stop_all(processes)
    return result


def _api_costs(args: argparse.Namespace, database_url: str) -> dict[str, object]:
    data = _input_file(args.lines)
    with TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
        env.update(BATCHINFER_DATA_DIR=tmp, BATCHINFER_DATABASE_URL=database_url, PYTHONPATH=str(ROOT))
        cli = [sys.executable, "-m", "worker.cli"]
        subprocess.run([*cli, "db", "upgrade"], env=env, cwd=ROOT, check=True)
        port = 18000 + secrets.randbelow(2000)
        base_url = f"http://127.0.0.1:{port}"
        api = subprocess.Popen(
            [*cli, "api", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for_health(base_url)
            with httpx.Client(base_url=base_url, timeout=600) as client:
                client.get("/v1/batches").raise_for_status()  # warm
                Path(f"/proc/{api.pid}/clear_refs").write_text("5")
                baseline_kb = _status_kb(api.pid, "VmRSS")
                start = time.perf_counter()
                created = client.post(
                    "/v1/jobs",
                    files={"file": ("bench.jsonl", data)},
                    data={"endpoint": "/v1/chat/completions"},
                )
                created.raise_for_status()
                batch_id = created.json()["id"]
                while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] == "validating":
                    time.sleep(0.05)
                validation_s = time.perf_counter() - start
                peak_kb = _status_kb(api.pid, "VmHWM")
                if batch["status"] != "in_progress" or batch["request_counts"]["total"] != args.lines:
                    raise RuntimeError(f"validation ended {batch['status']}: {batch.get('errors')}")
            latencies: list[float] = []
            lock = threading.Lock()
            threads = [
                threading.Thread(target=_poll, args=(base_url, batch_id, args.poll_seconds, latencies, lock))
                for _ in range(args.pollers)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            api.terminate()
            api.wait(30)

    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "lines": args.lines,
        "file_mb": round(len(data) / 1e6, 1),
        "validation_s": round(validation_s, 2),
        "validation_lines_per_s": round(args.lines / validation_s),
        "baseline_rss_mb": round(baseline_kb / 1024, 1),
        "validation_peak_rss_mb": round(peak_kb / 1024, 1),
        "pollers": args.pollers,
        "poll_requests": len(latencies),
        "poll_p50_ms": round(quantiles[49], 1),
        "poll_p99_ms": round(quantiles[98], 1),
    }


if __name__ == "__main__":
    main()
