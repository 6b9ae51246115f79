"""Shared service fixtures: settings in a tmp dir, a throwaway PostgreSQL database, brokers, clients.

Use them from any test module by importing the fixtures you need, e.g.
``from tests.helpers.service import service_settings, postgres_url  # noqa: F401`` (a fixture used
by another fixture must be imported too).

Fixtures:
- ``service_settings`` (function scope, parametrized ``sqlite`` / ``postgres``): env vars
  ``BATCHINFER_DATA_DIR`` = a tmp dir, the database migrated to head, the broker = the embedded
  SQLAlchemy broker in the tmp dir, ``get_settings()`` returning them, ``jobs.queue.celery_app``
  configured for them. The ``postgres`` variant carries the ``postgres`` marker, shares one database
  per test session (see ``postgres_url``) and empties its tables before each test.
- ``sqlite_settings``: the same, SQLite only.
- ``postgres_url`` (session scope; `postgres_database` for one of your own): a fresh database ``batchinfer_test_<hex>`` on the server at
  ``BATCHINFER_TEST_POSTGRES_URL`` (default ``postgresql+psycopg://root@127.0.0.1:5432/postgres``),
  migrated, dropped at the end; the test is skipped with the reason when the server is unreachable.
- ``redis_broker_url``: database 15 of the Redis at ``BATCHINFER_TEST_REDIS_URL`` (default
  ``redis://127.0.0.1:6379/0``), flushed before and after; skipped when Redis is unreachable. Mark
  such tests ``redis``.

Helpers: `configure_service` (the env + settings + migrations step, for custom fixtures),
`queued_tasks` (drain the broker and return the ``(task name, args)`` sent), `api_client`
(FastAPI `TestClient`; background tasks run before the response returns), `serve_http` (the app
under uvicorn on a loopback port, in a thread: responses leave as they would in production), `openai_client` (the real
``openai`` SDK over that client), `chat_line` / `completion_line` / `jsonl` (input files).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from jobs.config import BUILTIN_MODEL, Settings, get_settings
from jobs.db import dispose_engines, get_engine, upgrade_database
from jobs.queue import celery_app, configure_celery, work_queue

POSTGRES_ADMIN_URL = os.environ.get("BATCHINFER_TEST_POSTGRES_URL", "postgresql+psycopg://root@127.0.0.1:5432/postgres")
REDIS_TEST_URL = os.environ.get("BATCHINFER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0] + "/15"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def configure_service(
    monkeypatch: pytest.MonkeyPatch,
    data_dir: Path,
    *,
    database_url: str | None = None,
    broker_url: str | None = None,
    **env: str,
) -> Settings:
    """Point every ``BATCHINFER_*`` setting at ``data_dir`` (or the given URLs), migrate, return settings.

    Extra keyword arguments become ``BATCHINFER_<NAME>`` env vars (e.g. ``max_file_lines="3"``).
    """
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(data_dir))
    for name in ("DATABASE_URL", "BROKER_URL", "FILES_DIR", "RESULT_BACKEND"):
        monkeypatch.delenv(f"BATCHINFER_{name}", raising=False)
    if database_url:
        monkeypatch.setenv("BATCHINFER_DATABASE_URL", database_url)
    if broker_url:
        monkeypatch.setenv("BATCHINFER_BROKER_URL", broker_url)
    for name, value in env.items():
        monkeypatch.setenv(f"BATCHINFER_{name.upper()}", value)
    get_settings.cache_clear()
    settings = get_settings()
    configure_celery(settings)
    upgrade_database(settings.database_url)
    return settings


def _admin_connect() -> Any:
    import psycopg

    url = make_url(POSTGRES_ADMIN_URL)
    return psycopg.connect(
        host=url.host,
        port=url.port or 5432,
        user=url.username,
        password=url.password,
        dbname=url.database or "postgres",
        autocommit=True,
        connect_timeout=3,
    )


@contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database ``batchinfer_test_<hex>`` for the block (dropped afterwards);
    skips the test when the server is unreachable."""
    import psycopg

    try:
        admin = _admin_connect()
    except psycopg.OperationalError as exc:
        pytest.skip(f"PostgreSQL unreachable at {POSTGRES_ADMIN_URL}: {exc}")
    name = f"batchinfer_test_{secrets.token_hex(6)}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_database(url)
        yield url
    finally:
        dispose_engines()
        with _admin_connect() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session (dropped afterwards)."""
    with postgres_database() as url:
        yield url


def _teardown() -> None:
    get_settings.cache_clear()
    dispose_engines()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def service_settings(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Settings]:
    """Settings on SQLite or on PostgreSQL (see the module docstring)."""
    database_url = None
    if request.param == "postgres":
        database_url = request.getfixturevalue("postgres_url")
        with get_engine(database_url).begin() as connection:
            connection.execute(
                text(
                    "TRUNCATE batch_requests, batch_shards, batches, files, file_chunks, schedules, workers, api_keys, "
                    "eval_output_items, eval_runs, evals"
                )
            )
    yield configure_service(monkeypatch, tmp_path / "data", database_url=database_url)
    _teardown()


@pytest.fixture
def sqlite_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    """Settings on SQLite in a tmp dir, embedded broker."""
    yield configure_service(monkeypatch, tmp_path / "data")
    _teardown()


@pytest.fixture
def redis_broker_url() -> Iterator[str]:
    """Redis database 15, empty before and after the test."""
    import redis

    client = redis.Redis.from_url(REDIS_TEST_URL, socket_connect_timeout=2)
    try:
        client.flushdb()
    except redis.exceptions.ConnectionError as exc:
        pytest.skip(f"Redis unreachable at {REDIS_TEST_URL}: {exc}")
    yield REDIS_TEST_URL
    client.flushdb()
    client.close()


def queued_tasks(broker_url: str, queue: str | None = None) -> list[tuple[str, list[Any]]]:
    """Drain ``queue`` (default: the work queue of the settings' first model) on ``broker_url``; the
    ``(task name, args)`` of every message, in order."""
    queue = queue or work_queue(get_settings().served_model_name)
    tasks = []
    with celery_app.connection_for_read(broker_url) as connection:
        simple = connection.SimpleQueue(queue)
        try:
            while True:
                try:
                    message = simple.get(timeout=0.5)
                except simple.Empty:
                    break
                args, _kwargs, _embed = message.payload
                tasks.append((message.headers["task"], list(args)))
                message.ack()
        finally:
            simple.close()
    return tasks


def api_client(settings: Settings) -> Any:
    """A `TestClient` over ``create_app(settings)`` (use as a context manager or close it)."""
    from fastapi.testclient import TestClient

    from api.main import create_app

    return TestClient(create_app(settings))


@contextmanager
def serve_http(settings: Settings, timeout_s: float = 30) -> Iterator[str]:
    """Serve ``create_app(settings)`` with uvicorn on a free loopback port for the block; yields the base URL.

    Unlike `api_client`, the client and the app only share the socket, so what the app does after
    sending a response (e.g. a late commit) races the client's next request, as in production.
    """
    import uvicorn

    from api.main import create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def openai_client(test_client: Any, api_key: str = "unused") -> Any:
    """The ``openai`` SDK talking to ``test_client``'s app in process (no retries), sending ``api_key``."""
    import openai

    return openai.OpenAI(base_url=f"{test_client.base_url}/v1", api_key=api_key, http_client=test_client, max_retries=0)


def chat_line(custom_id: str, content: str = "Say hi.", *, model: str = BUILTIN_MODEL, **body: Any) -> dict[str, Any]:
    """One ``/v1/chat/completions`` input line."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": model, "messages": [{"role": "user", "content": content}], **body},
    }


def completion_line(
    custom_id: str, prompt: str | list[int] = "Once upon a time", *, model: str = BUILTIN_MODEL, **body: Any
) -> dict[str, Any]:
    """One ``/v1/completions`` input line."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"model": model, "prompt": prompt, **body},
    }


def jsonl(lines: list[dict[str, Any] | str]) -> bytes:
    """A JSONL file: dicts are JSON-encoded, strings are taken as raw lines."""
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
