"""Files every host can read (docs/architecture.md, "Files"): with ``BATCHINFER_FILE_STORAGE=database``
the API and a worker that has its own, empty data folder (standing in for another host) share only
PostgreSQL and Redis; the worker writes the output file and the API serves it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from jobs.config import BUILTIN_MODEL
from tests.e2e.processes import child_env, cli, free_port, running, wait_for_batch, wait_for_health
from tests.helpers.service import postgres_url  # noqa: F401  (fixture: a fresh, migrated database)

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def _files_in(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and "files" in p.parts]


def test_a_worker_with_its_own_data_folder_writes_the_output_the_api_serves(
    tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    from openai import OpenAI

    api_dir, worker_dir = tmp_path / "api-host", tmp_path / "worker-host"
    worker_dir.mkdir()
    shared = {"database_url": postgres_url, "broker_url": redis_url, "file_storage": "database"}
    port = free_port()
    api_log, worker_log = tmp_path / "api.log", tmp_path / "worker.log"
    with (
        running(
            cli("api", "--host", "127.0.0.1", "--port", str(port)), child_env(data_dir=str(api_dir), **shared), api_log
        ) as api,
        running(cli("worker", "--loglevel", "INFO"), child_env(data_dir=str(worker_dir), **shared), worker_log),
    ):
        base_url = f"http://127.0.0.1:{port}"
        wait_for_health(base_url, api, api_log)
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        lines = [
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": BUILTIN_MODEL, "prompt": f"{i} + {i} =", "max_tokens": 4, "temperature": 0},
            }
            for i in range(3)
        ]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = client.files.create(file=("q.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        done = wait_for_batch(client, batch.id, timeout_s=600, logs=[api_log, worker_log])
        assert done.status == "completed", done
        output = client.files.content(done.output_file_id).content.decode().splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == ["q0", "q1", "q2"]
    assert all(json.loads(line)["response"]["status_code"] == 200 for line in output)
    # Neither host kept file bytes on its disk: they live in PostgreSQL.
    assert _files_in(api_dir) == [] and _files_in(worker_dir) == []
