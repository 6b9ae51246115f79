"""Eval repository functions (`jobs.evals.repository`) on SQLite and PostgreSQL: items checked at create,
grades stored once, the run settled only when its batch ended and nothing is pending, paging, deletes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from jobs.config import BUILTIN_MODEL, Settings
from jobs.db import session_scope
from jobs.errors import InvalidRequest
from jobs.evals.repository import (
    ERROR,
    FAIL,
    PASS,
    Grade,
    create_eval,
    create_run,
    criterion_pass_rates,
    delete_eval,
    get_run,
    list_output_items,
    list_runs,
    mark_run_started,
    record_grades,
    settle_run,
    units_to_grade,
)
from jobs.models import EvalOutputItem, EvalRun
from jobs.paging import UnknownCursor
from jobs.status import BatchStatus
from jobs.storage import storage_from_settings
from tests.helpers.service import postgres_url, service_settings  # noqa: F401  (fixtures)

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}, "a": {"type": "string"}}, "required": ["q"]}
MODELS = {BUILTIN_MODEL: BUILTIN_MODEL}
CHECK = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.a}}",
    "operation": "eq",
}


def _eval_id(**overrides: Any) -> str:
    with session_scope() as session:
        return create_eval(
            session,
            item_schema=SCHEMA,
            include_sample_schema=False,
            testing_criteria=[CHECK],
            model_aliases=MODELS,
            **overrides,
        ).id


def _run(settings: Settings, eval_id: str, data_source: dict[str, Any]) -> EvalRun:
    with session_scope() as session:
        run = create_run(
            session,
            eval_id=eval_id,
            data_source=data_source,
            served_model=BUILTIN_MODEL,
            storage=storage_from_settings(settings),
            max_items=5,
        )
        session.expunge(run)
        return run


def _jsonl(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "jsonl", "source": {"type": "file_content", "content": rows}}


def test_items_are_checked_at_create_and_bad_ones_are_item_errors(service_settings: Settings) -> None:
    eval_id = _eval_id()
    rows = [{"item": {"q": "1", "a": "x"}, "sample": {"output_text": "x"}}, {"item": {"a": 3}}, {"item": {"q": "2"}}]
    run = _run(service_settings, eval_id, _jsonl(rows))
    assert (run.status, run.batch_id, run.num_total, run.num_errored) == ("queued", None, 3, 2)
    with session_scope() as session:
        items, has_more = list_output_items(session, eval_id=eval_id, run_id=run.id)
        assert not has_more
        assert [item.status for item in items] == ["pending", ERROR, ERROR]
        assert items[1].error is not None and "'q' is a required property" in items[1].error["message"]
        assert items[2].error is not None and items[2].error["code"] == "missing_sample"
        assert units_to_grade(session, run_id=run.id) == [None]


def test_more_items_than_the_limit_are_refused(service_settings: Settings) -> None:
    eval_id = _eval_id()
    with pytest.raises(InvalidRequest, match="at most 5"):
        _run(service_settings, eval_id, _jsonl([{"item": {"q": str(i)}} for i in range(6)]))


def test_cosine_needs_an_embedding_model_in_the_deployment(service_settings: Settings) -> None:
    cosine = {**CHECK, "name": "close", "type": "text_similarity", "evaluation_metric": "cosine", "pass_threshold": 0.5}
    del cosine["operation"]
    with session_scope() as session, pytest.raises(InvalidRequest, match="needs an embedding model") as refused:
        create_eval(
            session,
            item_schema=SCHEMA,
            include_sample_schema=False,
            testing_criteria=[CHECK, cosine],
            model_aliases=MODELS,
            has_embedding_model=False,
        )
    assert refused.value.param == "testing_criteria[1].evaluation_metric"
    with session_scope() as session:
        create_eval(
            session, item_schema=SCHEMA, include_sample_schema=False, testing_criteria=[cosine], model_aliases=MODELS
        )


def test_grades_count_once_and_the_run_settles_when_nothing_is_pending(service_settings: Settings) -> None:
    eval_id = _eval_id()
    rows = [{"item": {"q": str(i), "a": "x"}, "sample": {"output_text": "x"}} for i in range(3)]
    run = _run(service_settings, eval_id, _jsonl(rows))
    with session_scope() as session:
        ids = [item.id for item in list_output_items(session, eval_id=eval_id, run_id=run.id)[0]]
    grades = [
        Grade(ids[0], PASS, [], {}, None, [True]),
        Grade(ids[1], FAIL, [], {}, None, [False]),
    ]
    with session_scope() as session:
        assert record_grades(session, run_id=run.id, grades=grades) == 2
        assert settle_run(session, run_id=run.id) == "in_progress"  # one item still pending
    with session_scope() as session:
        # A duplicate grading of item 0 and the first grading of item 2 (the criterion errored).
        assert (
            record_grades(session, run_id=run.id, grades=[grades[0], Grade(ids[2], ERROR, [], {}, None, [None])]) == 1
        )
        assert settle_run(session, run_id=run.id) == "completed"
    with session_scope() as session:
        done = get_run(session, eval_id=eval_id, run_id=run.id)
        assert (done.num_passed, done.num_failed, done.num_errored) == (1, 1, 1)
        assert done.per_testing_criteria_results == [{"testing_criteria": "exact", "passed": 1, "failed": 1}]
        assert criterion_pass_rates(done) == {"exact": 0.5}
        assert done.completed_at is not None
        assert units_to_grade(session, run_id=run.id) == []


def test_paging_runs_and_output_items(service_settings: Settings) -> None:
    eval_id = _eval_id()
    rows = [{"item": {"q": str(i)}, "sample": {"output_text": ""}} for i in range(5)]
    run_ids = [_run(service_settings, eval_id, _jsonl(rows)).id for _ in range(3)]
    with session_scope() as session:
        first, has_more = list_runs(session, eval_id=eval_id, limit=2)
        assert [r.id for r in first] == run_ids[:2] and has_more
        rest, has_more = list_runs(session, eval_id=eval_id, after=first[-1].id)
        assert [r.id for r in rest] == run_ids[2:] and not has_more
        page, has_more = list_output_items(session, eval_id=eval_id, run_id=run_ids[0], limit=2, order="desc")
        assert [item.datasource_item_id for item in page] == [4, 3] and has_more
        page, _ = list_output_items(session, eval_id=eval_id, run_id=run_ids[0], after=page[-1].id, order="desc")
        assert [item.datasource_item_id for item in page] == [2, 1, 0]
        other_run_item = list_output_items(session, eval_id=eval_id, run_id=run_ids[1])[0][0]
        with pytest.raises(UnknownCursor):
            list_output_items(session, eval_id=eval_id, run_id=run_ids[0], after=other_run_item.id)


def test_delete_eval_removes_its_runs_and_items(service_settings: Settings) -> None:
    eval_id, kept_id = _eval_id(), _eval_id()
    _run(service_settings, eval_id, _jsonl([{"item": {"q": "1"}, "sample": {}}]))
    kept = _run(service_settings, kept_id, _jsonl([{"item": {"q": "1"}, "sample": {}}]))
    with session_scope() as session:
        delete_eval(session, eval_id=eval_id)
    with session_scope() as session:
        assert [run.id for run in session.query(EvalRun)] == [kept.id]
        assert {item.run_id for item in session.query(EvalOutputItem)} == {kept.id}


def test_concurrent_grading_tasks_add_up(service_settings: Settings) -> None:
    eval_id = _eval_id()
    rows = [{"item": {"q": str(i), "a": "x"}, "sample": {"output_text": "x"}} for i in range(5)]
    run = _run(service_settings, eval_id, _jsonl(rows))
    with session_scope() as session:
        ids = [item.id for item in list_output_items(session, eval_id=eval_id, run_id=run.id)[0]]

    def grade(item_ids: list[str]) -> int:
        with session_scope() as session:
            grades = [Grade(item_id, PASS, [], {}, None, [True]) for item_id in item_ids]
            return record_grades(session, run_id=run.id, grades=grades)

    # Two tasks share half their items (a duplicated message): each item counts once.
    with ThreadPoolExecutor(2) as pool:
        stored = list(pool.map(grade, [ids[:4], ids[1:]]))
    assert sum(stored) == 5
    with session_scope() as session:
        done = get_run(session, eval_id=eval_id, run_id=run.id)
        assert done.num_passed == 5 and done.per_testing_criteria_results[0]["passed"] == 5


def test_a_run_whose_batch_input_is_refused_fails_with_its_items_errored(service_settings: Settings) -> None:
    eval_id = _eval_id()
    rows = [{"item": {"q": str(i), "a": "x"}, "sample": {"output_text": "x"}} for i in range(2)]
    run = _run(service_settings, eval_id, _jsonl(rows))
    with session_scope() as session:
        errors = [{"code": "too_many_lines", "message": "the file has too many lines"}]
        mark_run_started(session, run_id=run.id, batch_status=BatchStatus.FAILED, errors=errors)
    with session_scope() as session:
        failed = get_run(session, eval_id=eval_id, run_id=run.id)
        assert (failed.status, failed.num_errored, failed.error) == ("failed", 2, errors[0])
        assert settle_run(session, run_id=run.id) == "failed"
        assert {item.status for item in list_output_items(session, eval_id=eval_id, run_id=run.id)[0]} == {ERROR}
