"""The Evals API through the real ``openai`` SDK (docs/api.md, "Evals"), on SQLite and PostgreSQL.

The worker's part is played through the repository, as in tests/api/test_openai_sdk.py: fixed answers
are recorded for the run's batch lines, then the grading messages the dispatch sends are run in this
process (`worker.eval_grading.grade_shard`), so every count is known in advance.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from jobs.api_keys import create_key
from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL, ModelEntry, Settings
from jobs.db import session_scope
from jobs.evals.dispatch import dispatch_after_shard
from jobs.models import BatchShard, EvalRun
from jobs.queue import GRADE_EVAL_SHARD
from jobs.reaper import reap
from jobs.repository import finalize_batch, get_batch, pending_requests, record_result
from jobs.shards import claim_next_shard
from tests.helpers.service import openai_client, queued_tasks
from worker.eval_grading import grade_shard

ITEM_SCHEMA = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["question", "answer"],
}
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
CONTAINS = {**EXACT, "name": "contains", "operation": "ilike"}
JUDGE_INPUT = [{"role": "user", "content": "Is {{sample.output_text}} right for {{item.question}}?"}]
LABEL_JUDGE = {
    "type": "label_model",
    "name": "judge",
    "model": BUILTIN_MODEL,
    "input": JUDGE_INPUT,
    "labels": ["yes", "no"],
    "passing_labels": ["yes"],
}
SCORE_JUDGE = {"type": "score_model", "name": "score", "model": BUILTIN_MODEL, "input": JUDGE_INPUT}
ITEMS = [
    {"item": {"question": "2+2?", "answer": "4"}},
    {"item": {"question": "Sky colour?", "answer": "Blue"}},
    {"item": {"question": "Capital of France?", "answer": "Paris"}},
    {"item": {"question": "no answer field"}},
]
ANSWERS = {"0": "4", "1": "It is blue", "2": "Lyon"}


@pytest.fixture
def sdk(client: Any) -> Iterator[openai.OpenAI]:
    yield openai_client(client)


def _completions_source(items: list[dict[str, Any]], **sampling: Any) -> dict[str, Any]:
    return {
        "type": "completions",
        "model": BUILTIN_MODEL,
        "source": {"type": "file_content", "content": items},
        "input_messages": {
            "type": "template",
            "template": [
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "{{item.question}}"},
            ],
        },
        "sampling_params": {"temperature": 0, "max_completion_tokens": 8, "seed": 7, **sampling},
    }


def _answer_every_line(batch_id: str, answers: dict[str, str], *, responses: bool = False) -> None:
    """Record ``answers[custom_id]`` as each line's completion (a worker's part), then finalize."""
    with session_scope() as session:
        assert claim_next_shard(session, owner="test:1", now=time.time(), lease_s=60)
        for row in pending_requests(session, batch_id=batch_id):
            if responses:
                ok = {"status_code": 200, "request_id": f"r-{row.id}", "body": _responses_body(answers[row.custom_id])}
                record_result(session, request_id=row.id, response=ok, error=None, prompt_tokens=5, completion_tokens=1)
                continue
            body = {
                "object": "chat.completion",
                "model": BUILTIN_MODEL,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": answers[row.custom_id]},
                    }
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            }
            response = {"status_code": 200, "request_id": f"r-{row.id}", "body": body}
            record_result(
                session, request_id=row.id, response=response, error=None, prompt_tokens=5, completion_tokens=1
            )
        finalize_batch(session, batch_id=batch_id)


def _responses_body(text: str) -> dict[str, Any]:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    usage = {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}
    return {"object": "response", "model": BUILTIN_MODEL, "status": "completed", "output": [message], "usage": usage}


def _grade_queued(settings: Settings) -> list[Any]:
    """Run every grading message the broker holds, as a worker would; returns their args."""
    tasks = [args for name, args in queued_tasks(settings.broker_url) if name == GRADE_EVAL_SHARD]
    for run_id, shard_id in tasks:
        grade_shard(run_id, shard_id)
    return tasks


def _batch_id(run_id: str) -> str:
    with session_scope() as session:
        run = session.get(EvalRun, run_id)
        assert run is not None and run.batch_id is not None
        return run.batch_id


def test_sdk_create_run_grade_and_read_output_items(sdk: openai.OpenAI, service_settings: Settings) -> None:
    created = sdk.evals.create(
        name="arith",
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True},
        testing_criteria=[EXACT, CONTAINS],
        metadata={"team": "evals"},
    )
    assert created.object == "eval" and created.name == "arith" and created.metadata == {"team": "evals"}
    assert created.data_source_config.type == "custom"
    assert created.data_source_config.schema_["properties"]["item"] == ITEM_SCHEMA
    assert [c.name for c in created.testing_criteria] == ["exact", "contains"]
    assert sdk.evals.retrieve(created.id).id == created.id

    run = sdk.evals.runs.create(created.id, name="first", data_source=_completions_source(ITEMS))
    assert run.object == "eval.run" and run.eval_id == created.id and run.model == BUILTIN_MODEL
    assert run.status == "queued" and run.report_url.endswith(f"/ui/evals/{created.id}/runs/{run.id}")
    assert (run.result_counts.total, run.result_counts.errored) == (4, 1)

    batch_id = _batch_id(run.id)
    with session_scope() as session:
        batch = get_batch(session, batch_id=batch_id)
        assert batch.status == "in_progress" and batch.total_requests == 3
        bodies = {row.custom_id: row.body for row in pending_requests(session, batch_id=batch_id)}
    assert bodies["2"]["messages"] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ]
    assert (bodies["2"]["temperature"], bodies["2"]["max_completion_tokens"], bodies["2"]["seed"]) == (0, 8, 7)
    assert sdk.evals.runs.retrieve(run.id, eval_id=created.id).status == "in_progress"

    _answer_every_line(batch_id, ANSWERS)
    dispatch_after_shard(batch_id, None)
    assert len(_grade_queued(service_settings)) == 1  # one shard

    done = sdk.evals.runs.retrieve(run.id, eval_id=created.id)
    assert done.status == "completed"
    # exact: "4" only; contains (ilike): "4" and "It is blue"; an item passes when every criterion does.
    counts = done.result_counts
    assert (counts.total, counts.passed, counts.failed, counts.errored) == (4, 1, 2, 1)
    by_name = {r.testing_criteria: (r.passed, r.failed) for r in done.per_testing_criteria_results}
    assert by_name == {"exact": (1, 2), "contains": (2, 1)}
    usage = done.per_model_usage[0]
    assert (usage.model_name, usage.invocation_count, usage.prompt_tokens, usage.completion_tokens) == (
        BUILTIN_MODEL,
        3,
        15,
        3,
    )

    items = list(sdk.evals.runs.output_items.list(run.id, eval_id=created.id, limit=2))
    assert [item.datasource_item_id for item in items] == [0, 1, 2, 3]
    assert [item.status for item in items] == ["pass", "fail", "fail", "error"]
    assert items[1].sample.output[0].content == "It is blue"
    assert items[1].sample.input[1].content == "Sky colour?"
    assert [(r.name, r.passed, r.score) for r in items[1].results] == [("exact", False, 0.0), ("contains", True, 1.0)]
    error = items[3].sample.error  # the item's schema error names the missing field
    assert error.code == "invalid_item" and "answer" in error.message
    passed = sdk.evals.runs.output_items.list(run.id, eval_id=created.id, status="pass")
    assert [item.datasource_item_id for item in passed] == [0]
    one = sdk.evals.runs.output_items.retrieve(items[0].id, eval_id=created.id, run_id=run.id)
    assert one.datasource_item == {"question": "2+2?", "answer": "4"}

    # A duplicate grading message changes nothing.
    with session_scope() as session:
        shard_id = session.scalar(select(BatchShard.id).where(BatchShard.batch_id == batch_id))
    assert grade_shard(run.id, shard_id).num_graded == 0
    again = sdk.evals.runs.retrieve(run.id, eval_id=created.id).result_counts
    assert (again.passed, again.failed, again.errored) == (1, 2, 1)


def test_a_jsonl_run_grades_the_given_samples(sdk: openai.OpenAI, service_settings: Settings) -> None:
    created = sdk.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[EXACT]
    )
    content = [
        {"item": {"question": "q", "answer": "yes"}, "sample": {"output_text": "yes"}},
        {"item": {"question": "q", "answer": "yes"}, "sample": {"output_text": "no"}},
        {"item": {"question": "q", "answer": "yes"}},
    ]
    run = sdk.evals.runs.create(
        created.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": content}}
    )
    assert [args[1] for args in _grade_queued(service_settings)] == [None]
    done = sdk.evals.runs.retrieve(run.id, eval_id=created.id)
    assert done.status == "completed" and done.per_model_usage == []
    assert (done.result_counts.passed, done.result_counts.failed, done.result_counts.errored) == (1, 1, 1)


def test_cancel_a_run_cancels_its_batch_and_ends_its_items(sdk: openai.OpenAI, service_settings: Settings) -> None:
    created = sdk.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[EXACT]
    )
    run = sdk.evals.runs.create(created.id, data_source=_completions_source(ITEMS[:2]))
    cancelled = sdk.evals.runs.cancel(run.id, eval_id=created.id)
    assert cancelled.status == "canceled" and cancelled.result_counts.errored == 2
    with session_scope() as session:
        assert get_batch(session, batch_id=_batch_id(run.id)).status == "cancelled"
    _grade_queued(service_settings)
    done = sdk.evals.runs.retrieve(run.id, eval_id=created.id)
    assert done.status == "canceled" and done.result_counts.to_dict() == cancelled.result_counts.to_dict()
    errors = [item.sample.error for item in sdk.evals.runs.output_items.list(run.id, eval_id=created.id)]
    assert [error.code for error in errors] == ["run_canceled", "run_canceled"]
    assert sdk.evals.runs.cancel(run.id, eval_id=created.id).status == "canceled"  # again: a no-op

    content = [{"item": {"question": "q", "answer": "a"}, "sample": {"output_text": "a"}}]
    jsonl_source = {"type": "jsonl", "source": {"type": "file_content", "content": content}}
    finished = sdk.evals.runs.create(created.id, data_source=jsonl_source)
    _grade_queued(service_settings)
    assert sdk.evals.runs.retrieve(finished.id, eval_id=created.id).status == "completed"
    with pytest.raises(openai.ConflictError):
        sdk.evals.runs.cancel(finished.id, eval_id=created.id)


def test_a_canceled_run_reports_final_counts_while_its_grading_is_still_queued(
    sdk: openai.OpenAI, service_settings: Settings
) -> None:
    """Cancel after generation, before grading: ``canceled`` comes with counts that add up to ``total`` and
    that the grading still queued does not change (it used to report zeros, then grade for seconds)."""
    created = sdk.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[EXACT]
    )
    run = sdk.evals.runs.create(created.id, data_source=_completions_source(ITEMS))
    batch_id = _batch_id(run.id)
    _answer_every_line(batch_id, ANSWERS)
    dispatch_after_shard(batch_id, None)
    cancelled = sdk.evals.runs.cancel(run.id, eval_id=created.id)
    counts = cancelled.result_counts
    assert cancelled.status == "canceled"
    assert (counts.total, counts.passed, counts.failed, counts.errored) == (4, 0, 0, 4)
    assert _grade_queued(service_settings)  # the grading sent before the cancel runs and stores nothing
    done = sdk.evals.runs.retrieve(run.id, eval_id=created.id)
    assert done.status == "canceled" and done.result_counts.to_dict() == counts.to_dict()
    statuses = [item.status for item in sdk.evals.runs.output_items.list(run.id, eval_id=created.id)]
    assert statuses == ["error"] * 4


def test_list_update_and_delete(sdk: openai.OpenAI) -> None:
    ids = [
        sdk.evals.create(
            name=f"e{i}", data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[EXACT]
        ).id
        for i in range(3)
    ]
    assert [e.id for e in sdk.evals.list(limit=2)] == ids
    assert [e.id for e in sdk.evals.list(order="desc").data] == ids[::-1]
    updated = sdk.evals.update(ids[0], name="renamed", metadata={"k": "v"})
    assert (updated.name, updated.metadata) == ("renamed", {"k": "v"})
    run = sdk.evals.runs.create(ids[0], data_source=_completions_source(ITEMS[:1]))
    assert [r.id for r in sdk.evals.runs.list(ids[0])] == [run.id]
    assert [r.id for r in sdk.evals.runs.list(ids[0], status="completed")] == []
    deleted_run = sdk.evals.runs.delete(run.id, eval_id=ids[0])
    assert (deleted_run.deleted, deleted_run.run_id) == (True, run.id)
    with pytest.raises(openai.NotFoundError):
        sdk.evals.runs.retrieve(run.id, eval_id=ids[0])
    assert sdk.evals.delete(ids[0]).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.evals.retrieve(ids[0])
    assert [e.id for e in sdk.evals.list()] == ids[1:]


@pytest.mark.parametrize(
    ("criteria", "config", "param", "words"),
    [
        ([{**EXACT, "type": "regex_check"}], {}, "testing_criteria[0].type", "unknown grader type 'regex_check'"),
        ([{**EXACT, "reference": "{{item.nope}}"}], {}, "testing_criteria[0].reference", "item.nope"),
        ([{**EXACT, "operation": "gt"}], {}, "testing_criteria[0].operation", ""),
        ([{**EXACT, "input": "{{ sample.output_text"}], {}, "testing_criteria[0].input", "does not parse"),
        ([EXACT], {"item_schema": {"type": "objekt"}}, "data_source_config.item_schema", "not a valid JSON schema"),
        ([EXACT, {**LABEL_JUDGE, "model": "gpt-4o"}], {}, "testing_criteria[1].model", "'gpt-4o' is not served"),
        ([{**SCORE_JUDGE, "model": "gpt-4o"}], {}, "testing_criteria[0].model", "'gpt-4o' is not served"),
        ([], {}, "testing_criteria", "at least one grader"),
        ([EXACT, CONTAINS, {**CONTAINS, "operation": "like"}], {}, "testing_criteria[2].name", "'contains'"),
    ],
)
def test_a_refused_eval_is_a_400_naming_the_problem(
    client: Any, criteria: list[dict[str, Any]], config: dict[str, Any], param: str, words: str
) -> None:
    body = {
        "data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA, **config},
        "testing_criteria": criteria,
    }
    response = client.post("/v1/evals", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        (
            {"input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.missing}}"}]}},
            "data_source.input_messages.template[0].content",
            "item.missing",
        ),
        ({"model": "gpt-4o"}, "data_source.model", "gpt-4o"),
        ({"sampling_params": {"temperature": 5}}, "data_source.sampling_params.temperature", "temperature"),
        ({"type": "stored_completions"}, "data_source.type", "stored_completions"),
        ({"type": "responses", "sampling_params": {"n": 2}}, "data_source.sampling_params.n", "completions"),
        ({"source": {"type": "file_id", "id": "file-nope"}}, "data_source.source.id", "file-nope"),
        (
            {"source": {"type": "file_content", "content": [ITEMS[0], ["not", "a", "row"]]}},
            "data_source.source.content[1]",
            "data_source.source.content[1] must be an object with an 'item'",
        ),
        (
            {"source": {"type": "file_content", "content": [{**ITEMS[0], "sample": "4"}]}},
            "data_source.source.content[0].sample",
            "data_source.source.content[0].sample must be an object",
        ),
    ],
)
def test_a_refused_run_is_a_400_naming_the_problem(client: Any, change: dict[str, Any], param: str, words: str) -> None:
    eval_id = client.post(
        "/v1/evals",
        json={"data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA}, "testing_criteria": [EXACT]},
    ).json()["id"]
    response = client.post(f"/v1/evals/{eval_id}/runs", json={"data_source": {**_completions_source(ITEMS), **change}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert client.get(f"/v1/evals/{eval_id}/runs").json()["data"] == []


def test_a_malformed_row_of_a_data_file_is_named_by_its_line(client: Any) -> None:
    eval_id = client.post(
        "/v1/evals",
        json={"data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA}, "testing_criteria": [EXACT]},
    ).json()["id"]
    lines = [json.dumps(ITEMS[0]), "", json.dumps({"question": "no item key"}), json.dumps(ITEMS[1])]
    upload = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("items.jsonl", "\n".join(lines))})
    assert upload.status_code == 200, upload.text
    source = {"type": "file_id", "id": upload.json()["id"]}
    response = client.post(
        f"/v1/evals/{eval_id}/runs", json={"data_source": {**_completions_source(ITEMS), "source": source}}
    )
    assert response.status_code == 400, response.text
    assert f"file {source['id']!r} line 3 must be an object with an 'item'" in response.json()["error"]["message"]


def test_a_model_grader_names_a_served_generate_model_or_its_alias(client: Any, service_settings: Settings) -> None:
    service_settings.models = [*service_settings.models, ModelEntry(name="tiny", source="/m/tiny", aliases=["t"])]

    def create(model: str) -> Any:
        body = {
            "data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA},
            "testing_criteria": [{**LABEL_JUDGE, "model": model}, {**SCORE_JUDGE, "model": model}],
        }
        return client.post("/v1/evals", json=body)

    for model in (BUILTIN_MODEL, "tiny", "t"):
        response = create(model)
        assert response.status_code == 200, response.text
        assert [c["model"] for c in response.json()["testing_criteria"]] == [model, model]
    refused = create(BUILTIN_EMBEDDING_MODEL)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "testing_criteria[0].model"


def test_unknown_ids_are_404(client: Any) -> None:
    assert client.get("/v1/evals/eval_nope").json()["error"]["code"] == "eval_not_found"
    eval_id = client.post(
        "/v1/evals",
        json={"data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA}, "testing_criteria": [EXACT]},
    ).json()["id"]
    assert client.get(f"/v1/evals/{eval_id}/runs/evalrun_nope").status_code == 404


def test_a_run_whose_batch_expires_fails_and_its_items_are_errors(
    sdk: openai.OpenAI, service_settings: Settings
) -> None:
    created = sdk.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[EXACT]
    )
    run = sdk.evals.runs.create(created.id, data_source=_completions_source(ITEMS[:2]))
    report = reap(now=time.time() + 2 * 24 * 3600)  # no worker came within the completion window
    assert report.finalized == {_batch_id(run.id): "expired"}
    assert len(_grade_queued(service_settings)) == 1
    done = sdk.evals.runs.retrieve(run.id, eval_id=created.id)
    assert done.status == "failed" and done.error.code == "batch_expired"
    assert (done.result_counts.errored, done.result_counts.passed) == (2, 0)


def test_each_key_sees_only_its_own_evals_runs_and_items(client: Any, service_settings: Settings) -> None:
    with session_scope() as session:
        alice, bob = (create_key(session, name=name).secret for name in ("alice", "bob"))
    as_alice, as_bob = openai_client(client, api_key=alice), openai_client(client, api_key=bob)
    created = as_alice.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[EXACT]
    )
    run = as_alice.evals.runs.create(created.id, data_source=_completions_source(ITEMS[:1]))
    item_id = next(iter(as_alice.evals.runs.output_items.list(run.id, eval_id=created.id))).id
    assert [e.id for e in as_bob.evals.list()] == []
    for call in (
        lambda: as_bob.evals.retrieve(created.id),
        lambda: as_bob.evals.update(created.id, name="mine"),
        lambda: as_bob.evals.delete(created.id),
        lambda: as_bob.evals.runs.create(created.id, data_source=_completions_source(ITEMS[:1])),
        lambda: as_bob.evals.runs.list(created.id),
        lambda: as_bob.evals.runs.retrieve(run.id, eval_id=created.id),
        lambda: as_bob.evals.runs.cancel(run.id, eval_id=created.id),
        lambda: as_bob.evals.runs.delete(run.id, eval_id=created.id),
        lambda: as_bob.evals.runs.output_items.list(run.id, eval_id=created.id),
        lambda: as_bob.evals.runs.output_items.retrieve(item_id, eval_id=created.id, run_id=run.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert as_alice.evals.runs.retrieve(run.id, eval_id=created.id).status == "in_progress"


def test_a_responses_run_sends_responses_lines_and_grades_their_output_text(
    sdk: openai.OpenAI, service_settings: Settings
) -> None:
    data_source = {
        **_completions_source(ITEMS[:2], max_completion_tokens=6),
        "type": "responses",
        "input_messages": {"type": "item_reference", "item_reference": "item.messages"},
    }
    data_source["sampling_params"].pop("seed")
    items = [{"item": {**ITEMS[i]["item"], "messages": [{"role": "user", "content": f"q{i}"}]}} for i in range(2)]
    data_source["source"] = {"type": "file_content", "content": items}
    schema = {**ITEM_SCHEMA, "properties": {**ITEM_SCHEMA["properties"], "messages": {"type": "array"}}}
    created = sdk.evals.create(
        data_source_config={"type": "custom", "item_schema": schema}, testing_criteria=[CONTAINS]
    )
    run = sdk.evals.runs.create(created.id, data_source=data_source)
    batch_id = _batch_id(run.id)
    with session_scope() as session:
        assert get_batch(session, batch_id=batch_id).endpoint == "/v1/responses"
        bodies = {row.custom_id: row.body for row in pending_requests(session, batch_id=batch_id)}
    assert bodies["1"]["input"] == [{"role": "user", "content": "q1"}] and bodies["1"]["max_output_tokens"] == 6
    _answer_every_line(batch_id, {"0": "four: 4", "1": "green"}, responses=True)
    dispatch_after_shard(batch_id, None)
    _grade_queued(service_settings)
    done = sdk.evals.runs.retrieve(run.id, eval_id=created.id)
    assert (done.status, done.result_counts.passed, done.result_counts.failed) == ("completed", 1, 1)
    outputs = [item.sample.output[0].content for item in sdk.evals.runs.output_items.list(run.id, eval_id=created.id)]
    assert outputs == ["four: 4", "green"]


def test_reading_a_run_takes_no_write_lock(sdk: openai.OpenAI, service_settings: Settings) -> None:
    """A worker storing a large run's grades holds SQLite's write lock; the run's GETs still answer at once
    (they read a WAL snapshot) instead of queueing behind it for the 30 s busy timeout."""
    if not service_settings.database_url.startswith("sqlite"):
        pytest.skip("the write lock is SQLite's; PostgreSQL readers never wait for writers")
    created = sdk.evals.create(
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA}, testing_criteria=[EXACT]
    )
    content = [{"item": {"question": "q", "answer": "a"}, "sample": {"output_text": "a"}}]
    run = sdk.evals.runs.create(
        created.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": content}}
    )
    reads: list[str] = []

    def read() -> None:
        reads.append(sdk.evals.retrieve(created.id).id)
        reads.append(sdk.evals.runs.retrieve(run.id, eval_id=created.id).status)
        reads.append(str(len(sdk.evals.runs.list(created.id).data)))
        reads.append(str(len(sdk.evals.runs.output_items.list(run.id, eval_id=created.id).data)))

    writer = sqlite3.connect(make_url(service_settings.database_url).database or "", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    reader = threading.Thread(target=read)
    try:
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), "a GET waited for the write lock"
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        reader.join()
    assert reads == [created.id, "in_progress", "1", "1"]
