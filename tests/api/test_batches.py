"""``/v1/batches`` over HTTP: the batch object field for field, validation outcome, paging, cancel."""

from __future__ import annotations

import json
import random
import time
from typing import Any

from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL, ModelEntry, Settings
from jobs.db import session_scope
from jobs.queue import RUN_SHARD
from jobs.schemas import RESPONSES
from jobs.shards import claim_next_shard
from tests.helpers.service import CHAT, COMPLETIONS, chat_line, completion_line, jsonl, queued_tasks

BATCH_KEYS = {
    "id",
    "object",
    "endpoint",
    "errors",
    "input_file_id",
    "completion_window",
    "status",
    "output_file_id",
    "error_file_id",
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "request_counts",
    "metadata",
    "model",
    "usage",
}


def _upload(client: Any, lines: list[Any]) -> str:
    response = client.post("/v1/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _create(client: Any, file_id: str, endpoint: str = CHAT, **extra: Any) -> Any:
    return client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra}
    )


def test_create_returns_validating_batch_then_validation_starts_it(client: Any, service_settings: Settings) -> None:
    file_id = _upload(client, [chat_line("a"), chat_line("b"), chat_line("c")])
    response = _create(client, file_id, metadata={"run": "nightly"})
    assert response.status_code == 200, response.text
    created = response.json()
    assert set(created) == BATCH_KEYS
    assert created["id"].startswith("batch_") and created["object"] == "batch"
    assert created["status"] == "validating"
    assert (created["endpoint"], created["input_file_id"], created["completion_window"]) == (CHAT, file_id, "24h")
    assert created["expires_at"] == created["created_at"] + 24 * 3600
    assert created["metadata"] == {"run": "nightly"}
    for key in (
        "errors",
        "output_file_id",
        "error_file_id",
        "in_progress_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    ):
        assert created[key] is None, key
    assert created["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert created["usage"] == {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }

    batch = client.get(f"/v1/batches/{created['id']}").json()
    assert batch["status"] == "in_progress" and batch["in_progress_at"] >= batch["created_at"]
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert batch["model"] == BUILTIN_MODEL
    assert queued_tasks(service_settings.broker_url) == [(RUN_SHARD, [])]


def test_bad_input_file_fails_the_batch_with_line_numbered_errors(client: Any, service_settings: Settings) -> None:
    lines = [chat_line("a"), "not json", chat_line("a"), completion_line("c"), chat_line("d", model="tiny")]
    service_settings.models = [*service_settings.models, ModelEntry(name="tiny", source="tiny")]
    batch_id = _create(client, _upload(client, lines)).json()["id"]
    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    assert batch["errors"]["object"] == "list"
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [
        (2, "invalid_json"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
        (5, "mismatched_model"),
    ]
    assert all(set(e) == {"code", "message", "param", "line"} for e in batch["errors"]["data"])
    assert batch["request_counts"]["total"] == 0
    assert batch["errors"]["total"] == 4
    assert queued_tasks(service_settings.broker_url) == []


def test_a_line_naming_an_unknown_model_is_a_400_of_its_own(client: Any, service_settings: Settings) -> None:
    batch_id = _create(client, _upload(client, [chat_line("a"), chat_line("b", model="gpt-4o")])).json()["id"]
    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert (batch["status"], batch["model"]) == ("in_progress", BUILTIN_MODEL)
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 1}
    assert queued_tasks(service_settings.broker_url) == [(RUN_SHARD, [])]
    cancelled = client.post(f"/v1/batches/{batch_id}/cancel").json()
    assert cancelled["status"] == "cancelled"
    errors = client.get(f"/v1/files/{cancelled['error_file_id']}/content").text.splitlines()
    by_id = {line["custom_id"]: line for line in map(json.loads, errors)}
    assert by_id["a"]["error"]["code"] == "batch_cancelled"
    rejected = by_id["b"]["response"]
    assert rejected["status_code"] == 400 and rejected["body"]["error"]["code"] == "model_not_found"
    assert rejected["body"]["error"]["param"] == "body.model"
    assert f"served: '{BUILTIN_MODEL}', '{BUILTIN_EMBEDDING_MODEL}'" in rejected["body"]["error"]["message"]


def test_errors_list_the_first_thousand_and_count_them_all(client: Any) -> None:
    batch_id = _create(client, _upload(client, ["not json"] * 1234)).json()["id"]
    errors = client.get(f"/v1/batches/{batch_id}").json()["errors"]
    assert (len(errors["data"]), errors["total"]) == (1000, 1234)
    assert errors["data"][-1]["line"] == 1000


def test_a_binary_file_is_one_invalid_encoding_error(client: Any) -> None:
    noise = random.Random(25).randbytes(1 << 20)
    file_id = client.post("/v1/files", files={"file": ("noise.bin", noise)}, data={"purpose": "batch"}).json()["id"]
    batch = client.get(f"/v1/batches/{_create(client, file_id).json()['id']}").json()
    assert batch["status"] == "failed"
    assert [e["code"] for e in batch["errors"]["data"]] == ["invalid_encoding"] and batch["errors"]["total"] == 1
    assert len(json.dumps(batch)) < 5000


def test_a_body_the_endpoint_rejects_does_not_fail_the_batch(client: Any) -> None:
    lines = [chat_line("a"), chat_line("b", temperature=9), chat_line("c", stream=True)]
    batch = client.get(f"/v1/batches/{_create(client, _upload(client, lines)).json()['id']}").json()
    assert batch["status"] == "in_progress" and batch["errors"] is None
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}


def test_completions_batch_and_deleted_input_file(client: Any) -> None:
    file_id = _upload(client, [completion_line("a", [1, 2, 3])])
    assert (
        client.get(f"/v1/batches/{_create(client, file_id, COMPLETIONS).json()['id']}").json()["status"]
        == "in_progress"
    )
    doomed = _upload(client, [chat_line("a")])
    assert client.delete(f"/v1/files/{doomed}").status_code == 200
    response = _create(client, doomed)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input_file_id"


def test_a_responses_batch_is_validated_like_the_others(client: Any) -> None:
    """``/v1/responses`` is a third endpoint (OpenAI's Batch API takes it): its lines pass the same
    structure checks, and a line of another endpoint in its file fails the batch naming that line."""
    line = {"custom_id": "r1", "method": "POST", "url": RESPONSES, "body": {"model": BUILTIN_MODEL, "input": "Hi"}}
    created = _create(client, _upload(client, [line]), RESPONSES).json()
    batch = client.get(f"/v1/batches/{created['id']}").json()
    assert (batch["endpoint"], batch["status"]) == (RESPONSES, "in_progress")
    mixed = client.get(
        f"/v1/batches/{_create(client, _upload(client, [line, chat_line('c')]), RESPONSES).json()['id']}"
    )
    assert [(e["line"], e["code"]) for e in mixed.json()["errors"]["data"]] == [(2, "invalid_url")]


def test_create_rejects_bad_parameters_with_openai_errors(client: Any) -> None:
    file_id = _upload(client, [chat_line("a")])
    cases = [
        ({"input_file_id": "file-missing", "endpoint": CHAT}, "input_file_id"),
        ({"input_file_id": file_id, "endpoint": "/v1/moderations"}, "endpoint"),
        ({"input_file_id": file_id, "endpoint": CHAT, "completion_window": "1h"}, "completion_window"),
        ({"input_file_id": file_id, "endpoint": CHAT, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input_file_id": file_id, "endpoint": CHAT, "metadata": {"k": 1}}, "metadata.k"),
        ({"endpoint": CHAT}, "input_file_id"),
    ]
    for body, param in cases:
        response = client.post("/v1/batches", json=body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    response = client.post("/v1/batches", content=b"garbage", headers={"Content-Type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == (None, "invalid_json")
    assert error["message"].startswith("the request body is not valid JSON") and "character 0" in error["message"]
    assert client.get("/v1/batches").json()["data"] == []


def test_list_pages_newest_first_with_cursor(client: Any) -> None:
    file_id = _upload(client, [chat_line("a")])
    created = [_create(client, file_id).json()["id"] for _ in range(5)]
    full = client.get("/v1/batches", params={"limit": 100}).json()
    # Newest first, also among batches created within the same second (ids sort by creation time).
    assert [b["id"] for b in full["data"]] == created[::-1] and not full["has_more"]
    keys = [(b["created_at"], b["id"]) for b in full["data"]]
    assert keys == sorted(keys, reverse=True)

    seen, after = [], None
    while True:
        page = client.get("/v1/batches", params={"limit": 2} | ({"after": after} if after else {})).json()
        assert page["object"] == "list" and len(page["data"]) <= 2
        assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        seen += [b["id"] for b in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == [b["id"] for b in full["data"]]
    assert client.get("/v1/batches", params={"after": "batch_nope"}).status_code == 400
    assert client.get("/v1/batches", params={"limit": 101}).status_code == 400
    empty = client.get("/v1/batches", params={"after": seen[-1]}).json()
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_cancel_unclaimed_batch_is_cancelled_at_once_with_error_file(client: Any) -> None:
    batch_id = _create(client, _upload(client, [chat_line("a"), chat_line("b")])).json()["id"]
    response = client.post(f"/v1/batches/{batch_id}/cancel")
    assert response.status_code == 200
    batch = response.json()
    assert batch["status"] == "cancelled" and batch["cancelling_at"] and batch["cancelled_at"]
    assert batch["output_file_id"] is None and batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    error_file = client.get(f"/v1/files/{batch['error_file_id']}").json()
    assert error_file["purpose"] == "batch_output"
    lines = [json.loads(line) for line in client.get(f"/v1/files/{batch['error_file_id']}/content").text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["a", "b"]
    assert {line["error"]["code"] for line in lines} == {"batch_cancelled"}
    again = client.post(f"/v1/batches/{batch_id}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_cancel_claimed_batch_waits_for_the_worker(client: Any) -> None:
    batch_id = _create(client, _upload(client, [chat_line("a")])).json()["id"]
    with session_scope() as session:
        assert claim_next_shard(session, owner="test:1", now=time.time(), lease_s=60)
    batch = client.post(f"/v1/batches/{batch_id}/cancel").json()
    assert batch["status"] == "cancelling" and batch["cancelled_at"] is None


def test_cancel_failed_batch_conflicts_and_unknown_batch_is_404(client: Any) -> None:
    batch_id = _create(client, _upload(client, ["garbage"])).json()["id"]
    conflict = client.post(f"/v1/batches/{batch_id}/cancel")
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "invalid_status"
    for response in (client.post("/v1/batches/batch_nope/cancel"), client.get("/v1/batches/batch_nope")):
        assert response.status_code == 404 and response.json()["error"]["code"] == "batch_not_found"
    route = client.get("/v1/batchez")
    assert route.status_code == 404 and route.json()["error"]["code"] == "not_found"
    method = client.put("/v1/batches")
    assert method.status_code == 405 and method.json()["error"] == {
        "message": "Method Not Allowed",
        "type": "invalid_request_error",
        "param": None,
        "code": "method_not_allowed",
    }


def _batch_left_validating(client: Any, service_settings: Settings) -> str:
    """A two-line batch created 5 s ago and never validated, as an API process that stopped would leave it."""
    from jobs.repository import create_batch

    file_id = _upload(client, [chat_line("a"), chat_line("b")])
    with session_scope(service_settings.database_url) as session:
        return create_batch(session, input_file_id=file_id, endpoint=CHAT, now=int(time.time()) - 5).id


def test_batches_left_validating_by_an_earlier_process_are_resumed_at_start_up(
    client: Any, service_settings: Settings
) -> None:
    """The API stopped between creating a batch and validating it: the next start-up validates and starts it."""
    from jobs.intake import resume_validating_batches
    from tests.helpers.service import api_client

    batch_id = _batch_left_validating(client, service_settings)
    assert resume_validating_batches(settings=service_settings, started_at=0) == []  # created after that start

    with api_client(service_settings) as restarted:
        deadline = time.monotonic() + 30
        while (batch := restarted.get(f"/v1/batches/{batch_id}").json())["status"] == "validating":
            assert time.monotonic() < deadline, "the left-over batch was never validated"
            time.sleep(0.05)

    assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 2
    assert queued_tasks(service_settings.broker_url) == [(RUN_SHARD, [])]


def test_a_line_nested_too_deep_fails_the_batch_at_validation(client: Any) -> None:
    deep = json.dumps(chat_line("deep")).replace('"Say hi."', "[" * 5000 + "1" + "]" * 5000)
    batch_id = _create(client, _upload(client, [chat_line("a"), deep])).json()["id"]
    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "failed"
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [(2, "invalid_json")]


def test_a_validation_that_raises_fails_the_batch_instead_of_leaving_it_validating(
    client: Any, monkeypatch: Any
) -> None:
    import jobs.intake

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(jobs.intake, "validate_input_file", broken)
    batch_id = _create(client, _upload(client, [chat_line("a")])).json()["id"]
    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    [error] = batch["errors"]["data"]
    assert (error["code"], error["line"]) == ("internal_error", None)
    assert "unexpected RuntimeError" in error["message"]


def test_a_batch_cancelled_while_its_validation_was_lost_ends_cancelled_at_start_up(
    client: Any, service_settings: Settings
) -> None:
    """The API stopped while validating a batch that was then cancelled: the next start-up finishes it."""
    from jobs.intake import resume_validating_batches
    from jobs.repository import cancel_batch

    batch_id = _batch_left_validating(client, service_settings)
    with session_scope(service_settings.database_url) as session:
        assert cancel_batch(session, batch_id=batch_id).status == "cancelling"

    assert resume_validating_batches(settings=service_settings) == [batch_id]

    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
