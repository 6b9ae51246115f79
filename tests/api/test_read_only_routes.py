"""Every GET reads in read-only transactions (`api.deps.ReadSessionDep`, `jobs.db.get_engine` with ``read_only``).

On SQLite a write transaction takes the database's one write lock (``BEGIN IMMEDIATE``), so a GET on one would
queue behind a worker storing results for up to the 30 s busy timeout, then fail. Each kind of route is served
here while another connection holds that lock, and must answer; on both databases every transaction the GETs
begin must be read-only. `test_every_get_route_is_checked` keeps the list complete as routes are added.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, event
from sqlalchemy.engine import make_url

from jobs import workers
from jobs.config import BUILTIN_MODEL, Settings, get_settings
from jobs.db import get_engine, is_read_only, session_scope
from jobs.status import now_s
from tests.helpers.service import CHAT, api_client, chat_line, jsonl, sqlite_settings  # noqa: F401

READ_ROUTES = {
    "batches": ["/v1/batches", "/v1/batches/{batch_id}"],
    "files": ["/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content"],
    "models": ["/v1/models", "/v1/models/{model_id}"],
    "workers": ["/v1/workers"],
    "schedules": ["/v1/schedules", "/v1/schedules/{schedule_id}"],
    "evals": [
        "/v1/evals",
        "/v1/evals/{eval_id}",
        "/v1/evals/{eval_id}/runs",
        "/v1/evals/{eval_id}/runs/{run_id}",
        "/v1/evals/{eval_id}/runs/{run_id}/output_items",
        "/v1/evals/{eval_id}/runs/{run_id}/output_items/{output_item_id}",
    ],
    "ui": ["/ui", "/ui/batches/{batch_id}", "/ui/files/{file_id}", "/ui/evals", "/ui/evals/{eval_id}/runs/{run_id}"],
    "health": ["/health"],
    "metrics": ["/metrics"],
}
"""Every GET route of the app, by kind (FastAPI's own ``/docs``, ``/redoc`` and ``/openapi.json`` read nothing)."""
FRAMEWORK_ROUTES = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
ITEM_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def _get_routes(routes: list[Any]) -> Iterator[str]:
    """The path of every GET route, those of included routers too."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _get_routes(included.routes)
        elif "GET" in (getattr(route, "methods", None) or ()):
            yield route.path


def _objects(client: Any, settings: Settings) -> dict[str, str]:
    """One of each object a GET path names: an uploaded file, its running batch, a schedule, a live worker,
    an eval with a run and an output item."""
    uploaded = client.post(
        "/v1/files", files={"file": ("in.jsonl", jsonl([chat_line("q1")]))}, data={"purpose": "batch"}
    )
    file_id = uploaded.json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})
    schedule = client.post("/v1/schedules", json={"cron": "0 3 * * *", "endpoint": CHAT, "input_file_id": file_id})
    created = client.post(
        "/v1/evals",
        json={"data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA}, "testing_criteria": [EXACT]},
    )
    eval_id = created.json()["id"]
    content = [{"item": {"answer": "a"}, "sample": {"output_text": "a"}}]
    data_source = {"type": "jsonl", "source": {"type": "file_content", "content": content}}
    run_id = client.post(f"/v1/evals/{eval_id}/runs", json={"data_source": data_source}).json()["id"]
    items = client.get(f"/v1/evals/{eval_id}/runs/{run_id}/output_items").json()["data"]
    with session_scope(settings.database_url) as session:
        workers.record_heartbeat(
            session,
            worker_id="host:1",
            host="host",
            pid=1,
            model=BUILTIN_MODEL,
            device="cpu",
            current_batch_id=batch.json()["id"],
            num_running_requests=1,
            tokens_per_s=1.0,
            metrics_port=9400,
            started_at=now_s(),
            now=now_s(),
        )
    return {
        "file_id": file_id,
        "batch_id": batch.json()["id"],
        "schedule_id": schedule.json()["id"],
        "model_id": BUILTIN_MODEL,
        "eval_id": eval_id,
        "run_id": run_id,
        "output_item_id": items[0]["id"],
    }


def _wait_for_start_up() -> None:
    """Join the app's start-up thread (`api.main`), whose writes are not the GETs'."""
    for thread in threading.enumerate():
        if thread.name == "api-start-up":
            thread.join()


def test_every_get_route_is_checked(sqlite_settings: Settings) -> None:
    with api_client(sqlite_settings) as client:
        found = set(_get_routes(client.app.routes)) - FRAMEWORK_ROUTES
    assert found == {path for paths in READ_ROUTES.values() for path in paths}


@pytest.mark.parametrize(
    ("kind", "file_storage"),
    [(kind, "local") for kind in sorted(READ_ROUTES)] + [("files", "database"), ("ui", "database")],
)
def test_gets_read_in_read_only_transactions_and_wait_for_no_writer(
    service_settings: Settings, monkeypatch: pytest.MonkeyPatch, kind: str, file_storage: str
) -> None:
    """``file_storage="database"``: file content comes from ``file_chunks`` rows, read by the API too."""
    monkeypatch.setenv("BATCHINFER_FILE_STORAGE", file_storage)
    get_settings.cache_clear()
    settings = get_settings()
    with api_client(settings) as client:
        ids = _objects(client, settings)
        _wait_for_start_up()
        begun: list[bool] = []

        def note_begin(connection: Connection) -> None:
            begun.append(is_read_only(connection))

        engine = get_engine(settings.database_url)
        event.listen(engine, "begin", note_begin)
        writer = None
        if engine.dialect.name == "sqlite":
            # A worker storing results holds the write lock while every GET runs: a GET on a write
            # transaction would wait out the 30 s busy timeout and answer 503 "database is locked".
            writer = sqlite3.connect(make_url(settings.database_url).database or "", isolation_level=None)
            writer.execute("BEGIN IMMEDIATE")
        try:
            answers = [(path, client.get(path)) for path in (t.format(**ids) for t in READ_ROUTES[kind])]
        finally:
            if writer is not None:
                writer.execute("ROLLBACK")
                writer.close()
            event.remove(engine, "begin", note_begin)
    for path, response in answers:
        assert response.status_code == 200, (path, response.text[:500])
    assert begun and all(begun), f"{begun.count(False)} of {len(begun)} transactions were not read-only"
