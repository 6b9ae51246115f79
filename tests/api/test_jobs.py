"""``POST /v1/jobs``: upload + create in one multipart call, and ``GET /health``."""

from __future__ import annotations

import json
from typing import Any

from jobs.config import BUILTIN_MODEL, Settings
from jobs.queue import RUN_SHARD
from tests.helpers.service import CHAT, api_client, chat_line, jsonl, queued_tasks


def _post_job(client: Any, data: bytes, **form: str) -> Any:
    return client.post("/v1/jobs", files={"file": ("job.jsonl", data)}, data={"endpoint": CHAT, **form})


def test_one_call_job_uploads_creates_validates_and_enqueues(client: Any, service_settings: Settings) -> None:
    data = jsonl([chat_line("a"), chat_line("b")])
    response = _post_job(client, data, metadata=json.dumps({"suite": "smoke"}))
    assert response.status_code == 200, response.text
    created = response.json()
    assert created["object"] == "batch" and created["status"] == "validating"
    assert created["metadata"] == {"suite": "smoke"}
    assert client.get(f"/v1/files/{created['input_file_id']}/content").content == data
    batch = client.get(f"/v1/batches/{created['id']}").json()
    assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 2
    assert queued_tasks(service_settings.broker_url) == [(RUN_SHARD, [])]


def test_job_with_bad_file_fails_with_errors(client: Any) -> None:
    created = _post_job(client, b"\xff\xfe\n").json()
    batch = client.get(f"/v1/batches/{created['id']}").json()
    assert batch["status"] == "failed"
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [("invalid_encoding", 1)]


def test_job_bad_parameters_are_400_and_store_nothing(client: Any) -> None:
    data = jsonl([chat_line("a")])
    cases = [
        (_post_job(client, data, metadata="{not json"), "metadata"),
        (_post_job(client, data, metadata='["a"]'), "metadata"),
        (_post_job(client, data, metadata='{"a": ' + "[" * 5000 + "]" * 5000 + "}"), "metadata"),
        (client.post("/v1/jobs", files={"file": ("j.jsonl", data)}, data={"endpoint": "/v1/moderations"}), "endpoint"),
        (_post_job(client, data, completion_window="2h"), "completion_window"),
        (client.post("/v1/jobs", files={"file": ("j.jsonl", data)}), "endpoint"),
    ]
    for response, param in cases:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert client.get("/v1/files").json()["data"] == []
    assert client.get("/v1/batches").json()["data"] == []


def test_health_ok_degraded_and_unavailable(client: Any, service_settings: Settings) -> None:
    assert client.get("/health").json() == {
        "status": "ok",
        "database": "ok",
        "broker": "ok",
        "model": BUILTIN_MODEL,
    }
    no_broker = service_settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    with api_client(no_broker) as degraded_client:
        response = degraded_client.get("/health")
    assert response.status_code == 200 and response.json()["status"] == "degraded"
    assert response.json()["database"] == "ok" and response.json()["broker"] != "ok"
    broken = service_settings.model_copy(update={"database_url": "postgresql+psycopg://nobody@127.0.0.1:1/none"})
    with api_client(broken) as broken_client:
        response = broken_client.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "unavailable"
        listing = broken_client.get("/v1/batches")
    assert listing.status_code == 503, listing.text
    error = listing.json()["error"]
    assert error["code"] == "database_unavailable" and "database" in error["message"]
