"""Many workers, one job: shards under leases, against PostgreSQL and a Redis server of the test's own.

The API (`batchinfer api`), beat (`batchinfer beat`, the reaper) and several worker processes
(`tests.e2e.counting_worker`: ``batchinfer worker`` whose engine writes down every line it finishes)
run as child processes, with the lease settings shortened (renewed every 1 s, lapsing after 6 s; the
reaper every 1 s). Workers are stopped the ways an operator or the kernel stops them: ``kill -9``,
SIGTERM, SIGQUIT, SIGTERM then SIGKILL. The broker is a ``redis-server`` this module starts on a free
port, so a test can stop it and start it again.

Most tests run the stand-in engine (steps of a known length, so "mid-shard" is a moment the test can
pick); the first runs the real model (SmolLM2) across three workers.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from jobs.config import BUILTIN_MODEL
from jobs.db import session_scope
from jobs.models import BatchRequest, BatchShard, RequestState
from tests.e2e.processes import (
    ROOT,
    TERMINAL,
    child_env,
    cli,
    free_port,
    interrupt,
    redis_server,
    running,
    wait_for_health,
)
from tests.helpers.service import postgres_database

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

LEASE = {"lease_renew_s": "1", "lease_expiry_s": "6", "reaper_interval_s": "1"}
RESUME_WITHIN_S = 90


class Service:
    """The API, beat and workers of one test, on ``database_url`` and a Redis of its own."""

    def __init__(self, tmp_path: Path, database_url: str, stack: ExitStack, **settings: str) -> None:
        self.tmp_path, self.stack = tmp_path, stack
        self.redis_port = free_port()
        self.run_log = tmp_path / "runs"
        self.run_log.mkdir()
        self.env = child_env(
            data_dir=str(tmp_path / "data"),
            database_url=database_url,
            broker_url=f"redis://127.0.0.1:{self.redis_port}/0",
            shard_target_tokens="200",
            **{**LEASE, **settings},
        )
        self.env["BATCHINFER_TEST_RUN_LOG"] = str(self.run_log)
        self.database_url = database_url
        self.logs: list[Path] = []
        self.processes: list[subprocess.Popen] = []  # API, beat and workers, in start order
        self.workers: list[subprocess.Popen] = []
        self.worker_logs: list[Path] = []
        self.redis = stack.enter_context(redis_server(self.redis_port, tmp_path / "redis"))
        self.base_url = ""

    def start_api_and_beat(self) -> None:
        port = free_port()
        api_log = self._log("api")
        api = self.stack.enter_context(
            running(cli("api", "--host", "127.0.0.1", "--port", str(port)), self.env, api_log)
        )
        beat = self.stack.enter_context(running(cli("beat", "--loglevel", "INFO"), self.env, self._log("beat")))
        self.processes += [api, beat]
        self.base_url = f"http://127.0.0.1:{port}"
        wait_for_health(self.base_url, api, api_log)

    def start_worker(self, engine: str = "stand_in", step_s: float = 0.1, max_num_seqs: int = 4) -> subprocess.Popen:
        env = dict(
            self.env,
            BATCHINFER_TEST_ENGINE=engine,
            BATCHINFER_TEST_STEP_S=str(step_s),
            BATCHINFER_TEST_MAX_NUM_SEQS=str(max_num_seqs),
        )
        command = [sys.executable, "-m", "tests.e2e.counting_worker"]
        log = self._log(f"worker{len(self.workers)}")
        worker = self.stack.enter_context(running(command, env, log))
        self.processes.append(worker)
        self.workers.append(worker)
        self.worker_logs.append(log)
        return worker

    def wait_workers_ready(self, timeout_s: float = 900) -> None:
        """Until every worker started consumes (Celery logs ``ready.``); start-up is slow on a busy machine."""
        deadline = time.monotonic() + timeout_s
        for worker, log in zip(self.workers, self.worker_logs, strict=True):
            while not (log.exists() and " ready." in log.read_text()):
                if worker.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"worker {worker.pid} did not start\n{self.tails()}")
                time.sleep(0.5)

    def _log(self, name: str) -> Path:
        path = self.tmp_path / f"{name}.log"
        self.logs.append(path)
        return path

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs if p.exists())

    def submit(self, lines: list[dict], **batch: object) -> str:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            data = "".join(json.dumps(line) + "\n" for line in lines).encode()
            upload = client.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"})
            assert upload.status_code == 200, upload.text
            body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
            created = client.post("/v1/batches", json={**body, **batch})
            assert created.status_code == 200, created.text
            return str(created.json()["id"])

    def batch(self, batch_id: str) -> dict:
        return httpx.get(f"{self.base_url}/v1/batches/{batch_id}", timeout=30).json()

    def cancel(self, batch_id: str) -> httpx.Response:
        return httpx.post(f"{self.base_url}/v1/batches/{batch_id}/cancel", timeout=30)

    def wait(self, batch_id: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = self.batch(batch_id)
            if batch["status"] in TERMINAL:
                return batch
            time.sleep(0.5)
        pytest.fail(f"batch {batch_id} still {batch['status']} after {timeout_s} s\n{self.tails()}")

    def files(self, batch: dict) -> tuple[dict[str, dict], dict[str, dict]]:
        """Output and error files by custom_id; fails when a custom_id appears twice in one file."""
        result = []
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id is None:
                result.append({})
                continue
            text = httpx.get(f"{self.base_url}/v1/files/{file_id}/content", timeout=60).text
            entries = [json.loads(line) for line in text.splitlines()]
            by_id = {entry["custom_id"]: entry for entry in entries}
            assert len(by_id) == len(entries), "a custom_id appears twice in one file"
            result.append(by_id)
        return result[0], result[1]

    def runs(self) -> Counter[str]:
        """How many times the engines finished each line (by request id), over every worker."""
        counts: Counter[str] = Counter()
        for log in self.run_log.glob("*.log"):
            counts.update(line.split()[1] for line in log.read_text().splitlines())
        return counts

    def run_times(self, pid: int | None = None) -> dict[str, float]:
        """Request id -> when a worker (all but ``pid``, when given) finished it first."""
        times: dict[str, float] = {}
        for log in self.run_log.glob("*.log"):
            if pid is not None and log.stem == str(pid):
                continue
            for line in log.read_text().splitlines():
                at, request_id = line.split()
                times[request_id] = min(times.get(request_id, float("inf")), float(at))
        return times


@pytest.fixture
def database_url() -> Iterator[str]:
    """A database of the test's own: a batch a failed test left behind must not reach the next test's workers."""
    with postgres_database() as url:
        yield url


@pytest.fixture
def service(tmp_path, database_url) -> Iterator[Service]:
    with ExitStack() as stack:
        service = Service(tmp_path, database_url, stack)
        yield service
        interrupt(service.processes)


def _lines(num: int, *, max_tokens: int = 4, prefix: str = "q") -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": BUILTIN_MODEL, "prompt": f"Item {i}: {i} + {i} =", "max_tokens": max_tokens},
        }
        for i in range(num)
    ]


def _assert_each_line_once(service: Service, batch: dict, num_lines: int, prefix: str = "q") -> tuple[dict, dict]:
    output, errors = service.files(batch)
    assert not set(output) & set(errors)
    assert set(output) | set(errors) == {f"{prefix}-{i}" for i in range(num_lines)}
    counts = batch["request_counts"]
    assert counts == {"total": num_lines, "completed": len(output), "failed": len(errors)}
    return output, errors


def _request_ids(database_url: str, batch_id: str) -> set[str]:
    with session_scope(database_url) as session:
        return set(session.scalars(select(BatchRequest.id).where(BatchRequest.batch_id == batch_id)))


def _wait_mid_shard(service: Service, batch_id: str, pid: int, timeout_s: float = 300) -> str:
    """Wait until worker ``pid`` holds a shard of which some lines, but not all, are committed; its id."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with session_scope(service.database_url) as session:
            shards = session.execute(
                select(BatchShard.id, BatchShard.num_requests).where(
                    BatchShard.batch_id == batch_id,
                    BatchShard.state == "running",
                    BatchShard.lease_owner.like(f"%:{pid}"),
                )
            ).all()
            for shard_id, num_requests in shards:
                done = session.scalar(
                    select(func.count()).where(
                        BatchRequest.shard_id == shard_id, BatchRequest.state != RequestState.PENDING.value
                    )
                )
                if 0 < (done or 0) < num_requests - 4:
                    return shard_id
        time.sleep(0.1)
    pytest.fail(f"worker {pid} was never seen mid-shard\n{service.tails()}")


def _committed(database_url: str, shard_id: str) -> set[str]:
    with session_scope(database_url) as session:
        query = select(BatchRequest.id).where(
            BatchRequest.shard_id == shard_id, BatchRequest.state != RequestState.PENDING.value
        )
        return set(session.scalars(query))


def test_500_lines_across_3_workers_on_the_real_model(service):
    service.start_api_and_beat()
    workers = [service.start_worker("real") for _ in range(3)]
    service.wait_workers_ready()
    batch_id = service.submit(_lines(500, max_tokens=2))

    batch = service.wait(batch_id, timeout_s=1800)

    assert batch["status"] == "completed", service.tails()
    output, errors = _assert_each_line_once(service, batch, 500)
    assert len(output) == 500 and errors == {}
    runs = service.runs()
    assert set(runs) == _request_ids(service.database_url, batch_id) and set(runs.values()) == {1}
    busy = [w.pid for w in workers if (service.run_log / f"{w.pid}.log").exists()]
    assert len(busy) >= 2, "the shards did not spread over the workers"


def test_kill_9_mid_shard_resumes_elsewhere_and_reruns_no_committed_line(service):
    service.start_api_and_beat()
    workers = [service.start_worker() for _ in range(3)]
    service.wait_workers_ready()
    batch_id = service.submit(_lines(500))
    victim = workers[1]
    shard_id = _wait_mid_shard(service, batch_id, victim.pid)

    victim.kill()
    victim.wait()
    killed_at = time.time()
    committed = _committed(service.database_url, shard_id)
    batch = service.wait(batch_id, timeout_s=600)

    assert batch["status"] == "completed", service.tails()
    output, errors = _assert_each_line_once(service, batch, 500)
    assert len(output) == 500 and errors == {}
    runs = service.runs()
    assert all(runs[request_id] == 1 for request_id in committed), "a committed line was computed again"
    with session_scope(service.database_url) as session:
        shard_lines = set(session.scalars(select(BatchRequest.id).where(BatchRequest.shard_id == shard_id)))
    others = service.run_times(pid=victim.pid)
    resumed_at = min(others[request_id] for request_id in shard_lines - committed)
    assert resumed_at - killed_at < RESUME_WITHIN_S


@pytest.mark.parametrize("how", ["SIGTERM", "SIGQUIT", "SIGTERM then SIGKILL"])
def test_a_stopped_worker_hands_its_shard_back_and_no_line_fails(service, how):
    service.start_api_and_beat()
    victim, _other = service.start_worker(), service.start_worker()
    service.wait_workers_ready()
    batch_id = service.submit(_lines(120))
    _wait_mid_shard(service, batch_id, victim.pid)

    victim.send_signal(signal.SIGQUIT if how == "SIGQUIT" else signal.SIGTERM)
    if how == "SIGTERM then SIGKILL":
        time.sleep(2)
        victim.kill()
    victim.wait(timeout=60)
    batch = service.wait(batch_id, timeout_s=600)

    assert batch["status"] == "completed", service.tails()
    output, errors = _assert_each_line_once(service, batch, 120)
    assert errors == {} and len(output) == 120
    runs = service.runs()
    assert set(runs) == _request_ids(service.database_url, batch_id)
    assert set(runs.values()) == {1}, {k: v for k, v in runs.items() if v != 1}


def test_cancelling_a_batch_whose_worker_was_killed_reaches_cancelled(service):
    service.start_api_and_beat()
    victim = service.start_worker()
    service.wait_workers_ready()
    batch_id = service.submit(_lines(60))
    _wait_mid_shard(service, batch_id, victim.pid)
    victim.kill()
    victim.wait()

    assert service.cancel(batch_id).json()["status"] in ("cancelling", "cancelled")
    batch = service.wait(batch_id, timeout_s=60)

    assert batch["status"] == "cancelled", service.tails()
    output, errors = _assert_each_line_once(service, batch, 60)
    assert output and {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}


def test_a_batch_created_while_the_broker_is_down_runs_once_it_is_back(service):
    service.start_api_and_beat()
    service.start_worker()
    service.wait_workers_ready()
    service.redis.terminate()
    service.redis.wait()
    health = httpx.get(f"{service.base_url}/health", timeout=30).json()
    assert health["status"] == "degraded" and health["broker"] != "ok"
    batch_id = service.submit(_lines(8))
    time.sleep(3)
    assert service.batch(batch_id)["status"] == "in_progress"

    service.redis = service.stack.enter_context(redis_server(service.redis_port, service.tmp_path / "redis"))
    back_at = time.monotonic()
    batch = service.wait(batch_id, timeout_s=RESUME_WITHIN_S)

    assert batch["status"] == "completed", service.tails()
    assert time.monotonic() - back_at < RESUME_WITHIN_S
    _assert_each_line_once(service, batch, 8)


def test_two_batches_back_to_back_both_progress_before_either_finishes(service):
    service.start_api_and_beat()
    service.start_worker(), service.start_worker()
    service.wait_workers_ready()
    first = service.submit(_lines(200, prefix="a"))
    second = service.submit(_lines(200, prefix="b"))
    progressed: dict[str, bool] = {first: False, second: False}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        batches = {batch_id: service.batch(batch_id) for batch_id in progressed}
        if any(batch["status"] in TERMINAL for batch in batches.values()):
            break
        for batch_id, batch in batches.items():
            progressed[batch_id] |= batch["request_counts"]["completed"] > 0
        time.sleep(0.2)
    assert all(progressed.values()), f"{progressed}\n{service.tails()}"
    for batch_id, prefix in ((first, "a"), (second, "b")):
        _assert_each_line_once(service, service.wait(batch_id, timeout_s=600), 200, prefix)


def test_a_batch_no_worker_takes_expires_at_its_window(tmp_path, database_url):
    with ExitStack() as stack:
        service = Service(tmp_path, database_url, stack, completion_window="8s")
        service.start_api_and_beat()
        batch_id = service.submit(_lines(10))
        assert service.batch(batch_id)["completion_window"] == "8s"

        batch = service.wait(batch_id, timeout_s=60)

        assert batch["status"] == "expired", service.tails()
        assert batch["expired_at"] - batch["created_at"] <= 8 + 5
        output, errors = _assert_each_line_once(service, batch, 10)
        assert output == {} and {e["error"]["code"] for e in errors.values()} == {"batch_expired"}


@pytest.mark.parametrize("moment", ["validating", "mid-run", "finalizing"])
def test_cancel_races_keep_every_line_in_exactly_one_file(service, moment):
    service.start_api_and_beat()
    service.start_worker(step_s=0.02), service.start_worker(step_s=0.02)
    service.wait_workers_ready()
    num_lines = 80
    batch_id = service.submit(_lines(num_lines))
    if moment != "validating":
        threshold = 5 if moment == "mid-run" else num_lines - 3
        deadline = time.monotonic() + 300
        while service.batch(batch_id)["request_counts"]["completed"] < threshold:
            assert time.monotonic() < deadline, service.tails()
            time.sleep(0.05)
    cancelled = service.cancel(batch_id)
    assert cancelled.status_code in (200, 409), cancelled.text

    batch = service.wait(batch_id, timeout_s=120)

    assert batch["status"] in ("cancelled", "completed")
    if moment != "finalizing":
        assert batch["status"] == "cancelled"
    _assert_each_line_once(service, batch, num_lines)


def test_ctrl_c_of_serve_mid_batch_hands_the_batch_back_on_the_embedded_defaults(tmp_path):
    """The zero-setup path (SQLite, embedded broker, the real model): Ctrl-C of ``batchinfer serve``
    mid-batch records no line as failed and leaves the batch to the next start, where it runs on
    and a cancel reaches ``cancelled``."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = child_env(data_dir=str(tmp_path / "data"), shard_target_tokens="400", **LEASE)
    lines = _lines(48, max_tokens=24)
    command = cli("serve", "--host", "127.0.0.1", "--port", str(port))

    def start(log: Path) -> subprocess.Popen:
        return subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
        )

    first_log = tmp_path / "serve1.log"
    serve = start(first_log)
    try:
        wait_for_health(base_url, serve, first_log, timeout_s=180)
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        file_id = httpx.post(
            f"{base_url}/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}, timeout=60
        ).json()["id"]
        batch_id = httpx.post(
            f"{base_url}/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"},
            timeout=60,
        ).json()["id"]
        deadline = time.monotonic() + 300
        while (done := httpx.get(f"{base_url}/v1/batches/{batch_id}", timeout=30).json())["request_counts"][
            "completed"
        ] < 1:
            assert time.monotonic() < deadline, first_log.read_text()[-4000:]
            time.sleep(0.2)
        assert done["status"] == "in_progress"
        os.killpg(serve.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        serve.wait(timeout=60)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()

    database_url = env_database_url(tmp_path / "data")
    with session_scope(database_url) as session:
        states = Counter(session.scalars(select(BatchShard.state).where(BatchShard.batch_id == batch_id)))
        num_failed = session.scalar(
            select(func.count()).where(
                BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.FAILED.value
            )
        )
    assert "running" not in states and states["queued"] >= 1 and num_failed == 0, states

    second_log = tmp_path / "serve2.log"
    serve = start(second_log)
    try:
        wait_for_health(base_url, serve, second_log, timeout_s=180)
        before = done["request_counts"]["completed"]
        deadline = time.monotonic() + 300
        while (batch := httpx.get(f"{base_url}/v1/batches/{batch_id}", timeout=30).json())["request_counts"][
            "completed"
        ] <= before and batch["status"] == "in_progress":
            assert time.monotonic() < deadline, second_log.read_text()[-4000:]
            time.sleep(0.2)
        httpx.post(f"{base_url}/v1/batches/{batch_id}/cancel", timeout=30)
        deadline = time.monotonic() + 120
        while (batch := httpx.get(f"{base_url}/v1/batches/{batch_id}", timeout=30).json())["status"] not in TERMINAL:
            assert time.monotonic() < deadline, f"stuck in {batch['status']}\n{second_log.read_text()[-4000:]}"
            time.sleep(0.5)
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    assert batch["status"] in ("cancelled", "completed"), batch
    assert batch["request_counts"]["total"] == 48
    assert batch["request_counts"]["completed"] + batch["request_counts"]["failed"] == 48


def env_database_url(data_dir: Path) -> str:
    """The zero-setup database of ``data_dir`` (`jobs.config.Settings`' default)."""
    return f"sqlite:///{data_dir.resolve() / 'batchinfer.db'}"
