"""``/v1/schedules`` over HTTP: create, retrieve, list, delete, errors, and the batches a tick creates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import delete

from jobs.config import Settings
from jobs.db import session_scope
from jobs.models import Schedule
from jobs.schedules import run_due_schedules
from tests.helpers.service import CHAT, chat_line, jsonl


@pytest.fixture(autouse=True)
def _no_schedules(service_settings: Settings) -> Iterator[None]:
    # NOTE: the shared PostgreSQL test database is emptied per test by the service fixture, except this table.
    with session_scope(service_settings.database_url) as session:
        session.execute(delete(Schedule))
    yield
    with session_scope(service_settings.database_url) as session:
        session.execute(delete(Schedule))


def _upload(client: Any, num_lines: int = 2) -> str:
    data = jsonl([chat_line(f"q-{idx}") for idx in range(num_lines)])
    response = client.post("/v1/files", files={"file": ("eval.jsonl", data)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _create(client: Any, **overrides: Any) -> Any:
    return client.post("/v1/schedules", json={"cron": "0 3 * * *", "endpoint": CHAT, **overrides})


def test_round_trip(client: Any) -> None:
    file_id = _upload(client)
    response = _create(client, input_file_id=file_id, metadata={"suite": "nightly"})
    assert response.status_code == 200, response.text
    schedule = response.json()
    assert schedule["id"].startswith("sched_")
    assert schedule["object"] == "schedule"
    assert (schedule["cron"], schedule["input_file_id"], schedule["endpoint"]) == ("0 3 * * *", file_id, CHAT)
    assert schedule["metadata"] == {"suite": "nightly"}
    assert schedule["completion_window"] == "24h"
    assert schedule["next_run_at"] > schedule["created_at"]
    assert schedule["next_run_at"] % 86400 == 3 * 3600  # 03:00 UTC
    assert (schedule["last_run_at"], schedule["last_batch_id"]) == (None, None)

    assert client.get(f"/v1/schedules/{schedule['id']}").json() == schedule

    deleted = client.delete(f"/v1/schedules/{schedule['id']}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": schedule["id"], "object": "schedule.deleted", "deleted": True}
    missing = client.get(f"/v1/schedules/{schedule['id']}")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "schedule_not_found"
    assert client.delete(f"/v1/schedules/{schedule['id']}").status_code == 404


def test_list_pages_newest_first(client: Any) -> None:
    file_id = _upload(client)
    ids = [_create(client, input_file_id=file_id).json()["id"] for _ in range(3)]
    everything = client.get("/v1/schedules").json()
    assert everything["object"] == "list"
    newest_first = [schedule["id"] for schedule in everything["data"]]
    assert sorted(newest_first) == sorted(ids) and everything["has_more"] is False
    first = client.get("/v1/schedules", params={"limit": 2}).json()
    assert [s["id"] for s in first["data"]] == newest_first[:2]
    assert (first["first_id"], first["last_id"], first["has_more"]) == (newest_first[0], newest_first[1], True)
    rest = client.get("/v1/schedules", params={"limit": 2, "after": first["last_id"]}).json()
    assert [s["id"] for s in rest["data"]] == newest_first[2:] and rest["has_more"] is False
    assert client.get("/v1/schedules", params={"after": "sched_nope"}).status_code == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"cron": "0 3 * *"}, "cron"),
        ({"cron": "0 25 * * *"}, "cron"),
        ({"input_file_id": "file-nope"}, "input_file_id"),
        ({"endpoint": "/v1/moderations"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"cron_expression": "0 3 * * *"}, "cron_expression"),
        ({"metadata": {"schedule_id": "mine"}}, "metadata"),
        ({"metadata": {f"k{idx}": "v" for idx in range(16)}}, "metadata"),
    ],
)
def test_bad_request_is_a_400_naming_the_field(client: Any, body: dict[str, Any], param: str) -> None:
    response = _create(client, **{"input_file_id": _upload(client), **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert client.get("/v1/schedules").json()["data"] == []


def test_tick_creates_the_batch_post_v1_batches_would(client: Any) -> None:
    file_id = _upload(client, num_lines=3)
    schedule = _create(client, input_file_id=file_id, metadata={"suite": "nightly"}).json()
    direct = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})
    expected = client.get(f"/v1/batches/{direct.json()['id']}").json()

    [run] = run_due_schedules(now=schedule["next_run_at"])

    after = client.get(f"/v1/schedules/{schedule['id']}").json()
    assert after["last_batch_id"] == run.batch_id
    assert after["last_run_at"] == schedule["next_run_at"]
    assert after["next_run_at"] == schedule["next_run_at"] + 86400
    batch = client.get(f"/v1/batches/{run.batch_id}").json()
    assert batch["metadata"] == {"suite": "nightly", "schedule_id": schedule["id"]}
    assert batch["created_at"] == schedule["next_run_at"]
    for field in ("endpoint", "input_file_id", "completion_window", "status", "request_counts", "model", "errors"):
        assert batch[field] == expected[field], field
    listed = [b["id"] for b in client.get("/v1/batches").json()["data"]]
    assert run.batch_id in listed


def test_a_file_with_a_line_nested_too_deep_is_the_400_of_any_invalid_file(client: Any) -> None:
    deep = json.dumps(chat_line("deep")).replace('"Say hi."', "[" * 5000 + "1" + "]" * 5000)
    data = jsonl([chat_line("ok"), deep])
    file_id = client.post("/v1/files", files={"file": ("deep.jsonl", data)}, data={"purpose": "batch"}).json()["id"]
    response = _create(client, input_file_id=file_id)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("input_file_id", "invalid_json")
    assert "line 2: the line nests arrays and objects more than 64 levels deep" in error["message"]


def test_a_file_a_schedule_uses_cannot_be_deleted_until_the_schedule_is(client: Any) -> None:
    """Deleting it would leave the schedule creating nothing at every tick: a 409 naming the schedules."""
    file_id = _upload(client)
    first, second = (_create(client, input_file_id=file_id).json()["id"] for _ in range(2))

    refused = client.delete(f"/v1/files/{file_id}")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "file_in_use", None)
    assert first in error["message"] and second in error["message"]
    assert client.get(f"/v1/files/{file_id}").status_code == 200

    client.delete(f"/v1/schedules/{first}")
    assert client.delete(f"/v1/files/{file_id}").status_code == 409
    client.delete(f"/v1/schedules/{second}")
    deleted = client.delete(f"/v1/files/{file_id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True


EVAL_ITEMS = [
    {"item": {"answer": "yes"}, "sample": {"output_text": "yes"}},
    {"item": {"answer": "yes"}, "sample": {"output_text": "no"}},
]


def _create_eval(client: Any) -> str:
    criterion = {
        "type": "string_check",
        "name": "exact",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "eq",
    }
    item_schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    body = {"data_source_config": {"type": "custom", "item_schema": item_schema}, "testing_criteria": [criterion]}
    response = client.post("/v1/evals", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def test_a_scheduled_eval_creates_a_run_at_each_tick(client: Any, service_settings: Settings) -> None:
    from jobs.queue import GRADE_EVAL_SHARD
    from tests.helpers.service import queued_tasks
    from worker.eval_grading import grade_shard

    eval_id = _create_eval(client)
    run = {"data_source": {"type": "jsonl", "source": {"type": "file_content", "content": EVAL_ITEMS}}, "name": "n"}
    response = client.post("/v1/schedules", json={"cron": "0 3 * * *", "eval_id": eval_id, "run": run})
    assert response.status_code == 200, response.text
    schedule = response.json()
    assert (schedule["eval_id"], schedule["input_file_id"], schedule["endpoint"]) == (eval_id, None, None)

    first_at = schedule["next_run_at"]
    fired = [
        run_due_schedules(now=first_at),
        run_due_schedules(now=first_at + 60),
        run_due_schedules(now=first_at + 86400),
    ]
    assert [len(runs) for runs in fired] == [1, 0, 1]  # the second tick of the same day finds it no longer due
    for name, (run_id, shard_id) in queued_tasks(service_settings.broker_url):
        if name == GRADE_EVAL_SHARD:
            grade_shard(run_id, shard_id)

    runs = client.get(f"/v1/evals/{eval_id}/runs").json()["data"]
    assert [r["id"] for r in runs] == [fired[0][0].run_id, fired[2][0].run_id]
    for listed, at in zip(runs, (first_at, first_at + 86400), strict=True):
        assert listed["status"] == "completed" and listed["created_at"] == at
        assert listed["metadata"] == {"schedule_id": schedule["id"]} and listed["name"] == "n"
        assert (listed["result_counts"]["passed"], listed["result_counts"]["failed"]) == (1, 1)
    after = client.get(f"/v1/schedules/{schedule['id']}").json()
    assert (after["last_run_id"], after["last_run_at"]) == (runs[1]["id"], first_at + 86400)


def test_deleting_an_eval_deletes_the_schedules_of_its_runs(client: Any) -> None:
    eval_id, kept_eval_id = _create_eval(client), _create_eval(client)
    run = {"data_source": {"type": "jsonl", "source": {"type": "file_content", "content": EVAL_ITEMS}}}
    schedule_ids = [
        client.post("/v1/schedules", json={"cron": "0 3 * * *", "eval_id": e, "run": run}).json()["id"]
        for e in (eval_id, eval_id, kept_eval_id)
    ]
    batch_schedule_id = _create(client, input_file_id=_upload(client)).json()["id"]
    assert client.delete(f"/v1/evals/{eval_id}").status_code == 200
    assert [client.get(f"/v1/schedules/{s}").status_code for s in schedule_ids] == [404, 404, 200]
    assert client.get(f"/v1/schedules/{batch_schedule_id}").status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"eval_id": "eval_nope", "run": {"data_source": {"type": "jsonl"}}}, "eval_id"),
        ({"run": {"data_source": {"type": "jsonl", "source": {"type": "nope"}}}}, "run.data_source.source"),
        ({"run": None}, "run"),
        ({"input_file_id": "file-x"}, "eval_id"),
    ],
)
def test_a_refused_eval_schedule_is_a_400_naming_the_field(client: Any, body: dict[str, Any], param: str) -> None:
    response = client.post("/v1/schedules", json={"cron": "0 3 * * *", "eval_id": _create_eval(client), **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
