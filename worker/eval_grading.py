"""Grade one shard of an eval run: each item's samples against every testing criterion.

Called by the ``GRADE_EVAL_SHARD`` task (`worker.tasks`). Reads the shard's pending items and their
lines' results (`jobs.evals.repository.items_to_grade`), grades outside any transaction
(`worker.grading.grade_items`: sandboxed criteria run one sandbox per core
across the shard's items), stores the grades in one transaction, then settles the run. An item
whose line failed (a 400, a context overflow, a cancelled or expired batch) is an ``error`` item with
that line's error as its sample's ``error``; a grader that fails on an item errors that item only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from jobs.db import session_scope
from jobs.evals.criteria import TestingCriterion, needs_model, parse_testing_criteria
from jobs.evals.data_sources import RunDataSource, api_sample, parse_data_source, samples_from_response
from jobs.evals.repository import ERROR, FAIL, PASS, Grade, ItemToGrade, items_to_grade, record_grades, settle_run
from jobs.models import Eval, EvalRun, RequestState
from worker.grading import GradeResult, ModelGrader, grade_items

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ShardGrading:
    """What one grading task did: items graded (stored) and the run's status afterwards."""

    num_graded: int
    run_status: str | None


def grade_shard(
    run_id: str, shard_id: str | None, *, model_grader: ModelGrader | None = None, database_url: str | None = None
) -> ShardGrading:
    """Grade the run's pending items of ``shard_id`` (None: those with their own sample) and settle the run.

    Args:
        model_grader: the served model for model graders (None: a criterion that needs one errors its items).
    """
    with session_scope(database_url) as session:
        run = session.get(EvalRun, run_id)
        if run is None:
            return ShardGrading(0, None)
        eval_row = session.get(Eval, run.eval_id)
        assert eval_row is not None
        criteria = parse_testing_criteria(eval_row.testing_criteria)
        data_source = parse_data_source(
            run.data_source, item_schema=eval_row.data_source_config["item_schema"], served_model=run.model
        )
        todo = items_to_grade(session, run_id=run_id, shard_id=shard_id)
    grades = _grade_all(todo, criteria, data_source, model_grader)
    with session_scope(database_url) as session:
        num_graded = record_grades(session, run_id=run_id, grades=grades)
        status = settle_run(session, run_id=run_id)
    logger.info("eval run %s shard %s: %d items graded; run %s", run_id, shard_id, num_graded, status)
    return ShardGrading(num_graded, status)


@dataclass(slots=True)
class _Sampled:
    """An item whose samples are graded: the grader's samples and the output item's API sample."""

    item: ItemToGrade
    samples: list[dict[str, Any]]
    api_sample: dict[str, Any]


def _sampled(item: ItemToGrade, data_source: RunDataSource, num_criteria: int) -> _Sampled | Grade:
    """The item's samples, or its ``error`` grade when its line failed."""
    if item.line_state is None:
        sample = item.given_sample or {}
        return _Sampled(item, [{"output_text": "", "choices": [], "model": "", "usage": {}, **sample}], sample)
    response = item.response or {}
    if item.line_state != RequestState.COMPLETED.value:
        error = item.line_error or _response_error(response)
        sample = api_sample(data_source, request_body=item.request_body, samples=[], error=error)
        return Grade(item.item_id, ERROR, [], sample, error, [None] * num_criteria)
    assert data_source.endpoint is not None
    samples = samples_from_response(data_source.endpoint, response.get("body") or {})
    return _Sampled(item, samples, api_sample(data_source, request_body=item.request_body, samples=samples, error=None))


def _grade_all(
    todo: list[ItemToGrade],
    criteria: list[TestingCriterion],
    data_source: RunDataSource,
    model_grader: ModelGrader | None,
) -> list[Grade]:
    """Every item's grade, in ``todo``'s order. Each criterion grades all items in one `grade_items`
    call, so sandboxed criteria (``python``, ``code_execution``) run one sandbox per core across items."""
    prepared = [_sampled(item, data_source, len(criteria)) for item in todo]
    sampled = [entry for entry in prepared if isinstance(entry, _Sampled)]
    per_criterion = [_grade_criterion(criterion, sampled, model_grader) for criterion in criteria]
    outcomes = iter(zip(*per_criterion, strict=True)) if criteria else iter([() for _ in sampled])
    grades: list[Grade] = []
    for entry in prepared:
        if isinstance(entry, Grade):
            grades.append(entry)
            continue
        results: list[dict[str, Any]] = []
        passed: list[bool | None] = []
        for criterion, outcome in zip(criteria, next(outcomes), strict=True):
            result: dict[str, Any] = {
                "name": criterion.name,
                "type": criterion.type,
                "score": 0.0 if outcome.score is None else outcome.score,
                "passed": outcome.passed and outcome.error is None,
                "sample": None,
            }
            if outcome.metrics:
                result["metrics"] = outcome.metrics
            if outcome.error is not None:
                result["error"] = outcome.error
            results.append(result)
            passed.append(None if outcome.error is not None else outcome.passed)
        status = ERROR if any(p is None for p in passed) else (PASS if all(passed) else FAIL)
        grades.append(Grade(entry.item.item_id, status, results, entry.api_sample, None, passed))
    return grades


def _grade_criterion(
    criterion: TestingCriterion, sampled: list[_Sampled], model_grader: ModelGrader | None
) -> list[GradeResult]:
    if needs_model(criterion) and model_grader is None:
        error = "this grader needs a served model and the grading worker has none"
        return [GradeResult(score=None, passed=False, error=error) for _ in sampled]
    pairs = [(entry.item.item, entry.samples) for entry in sampled]
    try:
        return grade_items(criterion, pairs, model_grader=model_grader)
    except Exception as exc:  # a grader bug must not fail the shard: its items error
        logger.exception("grader %s raised", criterion.name)
        error = f"the grader raised {type(exc).__name__}: {exc}"
        return [GradeResult(score=None, passed=False, error=error) for _ in sampled]


def _response_error(response: dict[str, Any]) -> dict[str, Any]:
    """``{code, message}`` of a line's non-200 response (OpenAI's error envelope in its body)."""
    error = ((response.get("body") or {}).get("error")) or {}
    return {"code": error.get("code") or "request_failed", "message": error.get("message") or "the request failed"}
