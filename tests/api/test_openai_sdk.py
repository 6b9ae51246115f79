"""The flow the real ``openai`` SDK drives (docs/api.md), against the app on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from jobs.config import BUILTIN_EMBEDDING_MODEL, Settings
from jobs.db import session_scope
from jobs.queue import RUN_SHARD
from jobs.repository import finalize_batch, pending_requests, record_result
from jobs.shards import claim_next_shard
from tests.helpers.service import CHAT, chat_line, jsonl, openai_client, queued_tasks


@pytest.fixture
def sdk(client: Any) -> Iterator[openai.OpenAI]:
    yield openai_client(client)


def test_sdk_upload_create_retrieve_run_download(sdk: openai.OpenAI, service_settings: Settings) -> None:
    data = jsonl([chat_line("q1", "What is 2+2?"), chat_line("q2", "Name a colour.")])
    uploaded = sdk.files.create(file=("questions.jsonl", data), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data) and uploaded.filename == "questions.jsonl"
    assert sdk.files.retrieve(uploaded.id).id == uploaded.id
    assert sdk.files.content(uploaded.id).content == data

    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"owner": "eval"}
    )
    assert batch.status == "validating" and batch.metadata == {"owner": "eval"}
    batch = sdk.batches.retrieve(batch.id)
    assert batch.status == "in_progress" and batch.request_counts.total == 2
    assert queued_tasks(service_settings.broker_url) == [(RUN_SHARD, [])]

    # Play the worker's part through the repository, as worker/ does.
    with session_scope() as session:
        assert claim_next_shard(session, owner="test:1", now=time.time(), lease_s=60)
        for row in pending_requests(session, batch_id=batch.id):
            body = {
                "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
            }
            record_result(
                session,
                request_id=row.id,
                response={"status_code": 200, "request_id": f"r-{row.id}", "body": body},
                error=None,
                prompt_tokens=7,
                completion_tokens=2,
                cached_tokens=3,
            )
        finalize_batch(session, batch_id=batch.id)

    done = sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert done.request_counts.completed == 2 and done.request_counts.failed == 0
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (14, 4, 18)
    assert done.usage.input_tokens_details.cached_tokens == 6
    lines = [json.loads(line) for line in sdk.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["q1", "q2"]
    assert all(line["response"]["body"]["choices"][0]["message"]["content"] == "ok" for line in lines)


def test_sdk_list_auto_paginates_and_cancel(sdk: openai.OpenAI) -> None:
    uploaded = sdk.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
    ids = [sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h").id for _ in range(3)]
    assert sorted(b.id for b in sdk.batches.list(limit=1)) == sorted(ids)
    first_page = sdk.batches.list(limit=2)
    assert len(first_page.data) == 2 and first_page.has_more
    cancelled = sdk.batches.cancel(ids[0])
    assert cancelled.status == "cancelled" and cancelled.error_file_id
    assert [f.purpose for f in sdk.files.list()].count("batch_output") == 1
    assert sdk.files.delete(uploaded.id).deleted


def test_sdk_sees_openai_errors(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.batches.retrieve("batch_missing")
    assert not_found.value.code == "batch_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.batches.create(input_file_id="file-missing", endpoint=CHAT, completion_window="24h")
    assert bad.value.param == "input_file_id"
    with pytest.raises(openai.BadRequestError) as bad_endpoint:
        sdk.batches.create(input_file_id="file-x", endpoint="/v1/moderations", completion_window="24h")
    assert bad_endpoint.value.param == "endpoint"
    uploaded = sdk.files.create(file=("bad.jsonl", b"nope\n"), purpose="batch")
    failed = sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    failed = sdk.batches.retrieve(failed.id)
    assert failed.status == "failed" and failed.errors is not None
    assert [(e.code, e.line) for e in failed.errors.data or []] == [("invalid_json", 1)]
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(failed.id)


def test_sdk_lists_and_retrieves_the_served_models(sdk: openai.OpenAI, service_settings: Settings) -> None:
    model, embedder = list(sdk.models.list())

    assert (model.id, model.object, model.owned_by) == (service_settings.served_model_name, "model", "batchinfer")
    assert (embedder.id, embedder.model_extra["kind"]) == (BUILTIN_EMBEDDING_MODEL, "embed")
    assert sdk.models.retrieve(model.id).id == model.id
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.models.retrieve("gpt-4o")
    assert not_found.value.code == "model_not_found"


def test_sdk_over_real_http_server(service_settings: Settings) -> None:
    """uvicorn on a free loopback port: validation runs after the create response, the client polls."""
    import socket
    import threading
    import time

    import uvicorn

    from api.main import create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(service_settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        uploaded = sdk.files.create(file=("in.jsonl", jsonl([chat_line("a"), chat_line("b")])), purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        while batch.status == "validating":
            assert time.monotonic() < deadline, "batch stuck in validating"
            time.sleep(0.05)
            batch = sdk.batches.retrieve(batch.id)
        assert batch.status == "in_progress" and batch.request_counts.total == 2
        assert queued_tasks(service_settings.broker_url) == [(RUN_SHARD, [])]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()
