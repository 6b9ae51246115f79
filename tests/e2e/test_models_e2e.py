"""Several models in one deployment: each batch runs on its own model's worker, a model without a worker
waits, and ``/v1/models`` follows the workers.

Real PostgreSQL, a Redis server of the test's own, and the API, beat and one ``batchinfer worker
--model NAME`` per model as child processes, with real engines: the built-in chat model, a tiny
random Llama checkpoint (tests/helpers/tiny_models.py) as a second generate model, and the built-in
embedding model. Heartbeats are
shortened (every 1 s, live for 4 s) so that a killed worker leaves ``/v1/models`` within seconds.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL
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

TINY = "tiny-llama"
EMBED = BUILTIN_EMBEDDING_MODEL
SETTINGS = {
    "worker_heartbeat_s": "1",
    "worker_dead_s": "3",
    "worker_live_s": "4",
    "reaper_interval_s": "1",
    "lease_renew_s": "1",
    "lease_expiry_s": "6",
}


class Deployment:
    """The API, beat and per-model workers of the test, each process logging to a file of its own."""

    def __init__(self, tmp_path: Path, stack: ExitStack, env: dict[str, str]) -> None:
        self.tmp_path, self.stack, self.env = tmp_path, stack, env
        self.logs: list[Path] = []
        self.processes: list[subprocess.Popen] = []  # API, beat and workers, in start order
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        api_log = self._log("api")
        api = stack.enter_context(running(cli("api", "--host", "127.0.0.1", "--port", str(port)), env, api_log))
        beat = stack.enter_context(running(cli("beat"), env, self._log("beat")))
        self.processes += [api, beat]
        wait_for_health(self.base_url, api, api_log)

    def _log(self, name: str) -> Path:
        path = self.tmp_path / f"{name}-{len(self.logs)}.log"
        self.logs.append(path)
        return path

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs if p.exists())

    def start_worker(self, model: str) -> subprocess.Popen:
        worker = self.stack.enter_context(running(cli("worker", "--model", model), self.env, self._log(model)))
        self.processes.append(worker)
        return worker

    def models(self) -> dict[str, tuple[int, int]]:
        """Model id -> (live workers, ready workers), from ``GET /v1/models``."""
        data = httpx.get(f"{self.base_url}/v1/models", timeout=30).json()["data"]
        return {m["id"]: (m["num_workers"], m["num_ready_workers"]) for m in data}

    def wait_for(self, what: str, condition: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"not within {timeout_s} s: {what}\n{self.tails()}")
            time.sleep(0.5)

    def submit(self, model: str, prefix: str, num_lines: int = 3) -> str:
        """A batch of ``num_lines`` completion lines (embedding lines for the embedding model) for ``model``."""
        embed = model == BUILTIN_EMBEDDING_MODEL
        url = "/v1/embeddings" if embed else "/v1/completions"
        lines = [
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": url,
                "body": {"model": model, "input": f"Item {i}"}
                if embed
                else {"model": model, "prompt": f"Item {i}: {i} + {i} =", "max_tokens": 3, "temperature": 0},
            }
            for i in range(num_lines)
        ]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            upload = client.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"})
            body = {"input_file_id": upload.json()["id"], "endpoint": url, "completion_window": "24h"}
            return str(client.post("/v1/batches", json=body).json()["id"])

    def batch(self, batch_id: str) -> dict:
        return httpx.get(f"{self.base_url}/v1/batches/{batch_id}", timeout=30).json()

    def wait_done(self, batch_id: str, timeout_s: float = 300) -> dict:
        self.wait_for(f"batch {batch_id} ends", lambda: self.batch(batch_id)["status"] in TERMINAL, timeout_s)
        return self.batch(batch_id)

    def output_models(self, batch: dict) -> set[str]:
        """The ``model`` of every response body in the batch's output file."""
        text = httpx.get(f"{self.base_url}/v1/files/{batch['output_file_id']}/content", timeout=30).text
        return {json.loads(line)["response"]["body"]["model"] for line in text.splitlines()}


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    from tests.helpers.tiny_models import save_tiny_model

    tiny_dir = save_tiny_model(tmp_path / TINY, "llama")
    models = {
        BUILTIN_MODEL: BUILTIN_MODEL,
        TINY: {"source": str(tiny_dir)},
        EMBED: {"source": BUILTIN_EMBEDDING_MODEL, "kind": "embed"},
    }
    with postgres_database() as database_url, ExitStack() as stack:
        redis_port = free_port()
        stack.enter_context(redis_server(redis_port, tmp_path / "redis"))
        env = child_env(
            data_dir=str(tmp_path / "data"),
            database_url=database_url,
            broker_url=f"redis://127.0.0.1:{redis_port}/0",
            models=json.dumps(models),
            **SETTINGS,
        )
        subprocess.run(cli("db", "upgrade"), env=env, cwd=ROOT, check=True, timeout=120)
        deployment = Deployment(tmp_path, stack, env)
        yield deployment
        interrupt(deployment.processes)


def test_each_batch_runs_on_its_models_worker_and_a_model_without_one_waits(deployment: Deployment) -> None:
    everyone = {BUILTIN_MODEL: (1, 1), TINY: (1, 1), EMBED: (1, 1)}
    assert deployment.models() == {BUILTIN_MODEL: (0, 0), TINY: (0, 0), EMBED: (0, 0)}
    deployment.start_worker(BUILTIN_MODEL)
    deployment.start_worker(TINY)
    embed_worker = deployment.start_worker(EMBED)
    deployment.wait_for("the three workers ready", lambda: deployment.models() == everyone, 600)

    chat_id, tiny_id, embed_id = (deployment.submit(m, m) for m in (BUILTIN_MODEL, TINY, EMBED))
    for batch_id, model in ((chat_id, BUILTIN_MODEL), (tiny_id, TINY), (embed_id, EMBED)):
        batch = deployment.wait_done(batch_id)
        assert (batch["status"], batch["model"], batch["request_counts"]["completed"]) == ("completed", model, 3)
        assert deployment.output_models(batch) == {model}

    os.kill(embed_worker.pid, signal.SIGKILL)
    deployment.wait_for("the killed worker leaves /v1/models", lambda: deployment.models()[EMBED] == (0, 0), 60)
    waiting_id = deployment.submit(EMBED, "waits")
    chat_id, tiny_id = deployment.submit(BUILTIN_MODEL, "chat-2"), deployment.submit(TINY, "tiny-2")
    assert deployment.wait_done(chat_id)["status"] == "completed"  # generate batches go on
    assert deployment.wait_done(tiny_id)["status"] == "completed"
    waiting = deployment.batch(waiting_id)
    assert (waiting["status"], waiting["request_counts"]["completed"]) == ("in_progress", 0)
    status = subprocess.run(
        cli("status", waiting_id, "--base-url", deployment.base_url),
        env=deployment.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"waiting: no worker serves model {EMBED}" in status
    assert (
        f"waiting: no worker serves model {EMBED}" in httpx.get(f"{deployment.base_url}/ui/batches/{waiting_id}").text
    )

    deployment.start_worker(EMBED)  # a worker returns: the waiting batch finishes
    batch = deployment.wait_done(waiting_id)
    assert (batch["status"], batch["request_counts"]["completed"]) == ("completed", 3)
    assert deployment.models() == everyone
