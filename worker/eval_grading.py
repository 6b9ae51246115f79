"""Grade one shard of an eval run: each item's samples against every testing criterion.

Called by the ``GRADE_EVAL_SHARD`` task (`worker.tasks`). Reads the shard's pending items and their
lines' results (`jobs.evals.repository.items_to_grade`), grades outside any transaction
(`worker.grading.grade_items`, one call per criterion), stores the grades in one transaction, then
settles the run. An item whose line failed (a 400, a context overflow, a cancelled or expired batch) is an ``error`` item with
that line's error as its sample's ``error``; a grader that fails on an item errors that item only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
    run_id: str,
    shard_id: str | None,
    *,
    model_grader: Callable[[], ModelGrader] | None = None,
    database_url: str | None = None,
) -> ShardGrading:
    """Grade the run's pending items of ``shard_id`` (None: those with their own sample) and settle the run.

    Each criterion grades the shard's items in one `worker.grading.grade_items` call (sandboxed graders
    run several items at once).

    Args:
        model_grader: builds the served model's judge, called only when a criterion needs one (None: such a
            criterion errors its items).
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
    judge = model_grader() if model_grader is not None and any(needs_model(c) for c in criteria) else None
    grades = _grade(todo, criteria, data_source, judge)
    with session_scope(database_url) as session:
        num_graded = record_grades(session, run_id=run_id, grades=grades)
        status = settle_run(session, run_id=run_id)
    logger.info("eval run %s shard %s: %d items graded; run %s", run_id, shard_id, num_graded, status)
    return ShardGrading(num_graded, status)


def _samples(item: ItemToGrade, data_source: RunDataSource) -> tuple[list[dict[str, Any]], dict[str, Any]] | Grade:
    """The graders' samples of one item and its API ``sample``, or its ``error`` grade when its line failed."""
    if item.line_state is None:
        sample = item.given_sample or {}
        return [{"output_text": "", "choices": [], "model": "", "usage": {}, **sample}], sample
    response = item.response or {}
    if item.line_state != RequestState.COMPLETED.value:
        error = item.line_error or _response_error(response)
        sample = api_sample(data_source, request_body=item.request_body, samples=[], error=error)
        return Grade(item.item_id, ERROR, [], sample, error, [])
    assert data_source.endpoint is not None
    samples = samples_from_response(data_source.endpoint, response.get("body") or {})
    return samples, api_sample(data_source, request_body=item.request_body, samples=samples, error=None)


def _grade(
    todo: list[ItemToGrade], criteria: list[TestingCriterion], data_source: RunDataSource, judge: ModelGrader | None
) -> list[Grade]:
    grades: list[Grade] = []
    gradable: list[tuple[ItemToGrade, list[dict[str, Any]], dict[str, Any]]] = []
    for item in todo:
        outcome = _samples(item, data_source)
        if isinstance(outcome, Grade):
            outcome.criteria_passed = [None] * len(criteria)
            grades.append(outcome)
        else:
            gradable.append((item, *outcome))
    results: list[list[dict[str, Any]]] = [[] for _ in gradable]
    passed: list[list[bool | None]] = [[] for _ in gradable]
    for criterion in criteria:
        for index, graded in enumerate(_grade_criterion(criterion, gradable, judge)):
            result: dict[str, Any] = {
                "name": criterion.name,
                "type": criterion.type,
                "score": 0.0 if graded.score is None else graded.score,
                "passed": graded.passed and graded.error is None,
                "sample": None,
            }
            for extra in ("metrics", "label", "sample_results"):
                if getattr(graded, extra, None):
                    result[extra] = getattr(graded, extra)
            if graded.error is not None:
                result["error"] = graded.error
            results[index].append(result)
            passed[index].append(None if graded.error is not None else graded.passed)
    for (item, _samples_of_item, api), item_results, item_passed in zip(gradable, results, passed, strict=True):
        status = ERROR if any(p is None for p in item_passed) else (PASS if all(item_passed) else FAIL)
        grades.append(Grade(item.item_id, status, item_results, api, None, item_passed))
    return grades


def _grade_criterion(
    criterion: TestingCriterion,
    gradable: list[tuple[ItemToGrade, list[dict[str, Any]], dict[str, Any]]],
    judge: ModelGrader | None,
) -> list[GradeResult]:
    """One criterion over the items; a grader that raises (a bug) errors those items, not the shard."""
    if needs_model(criterion) and judge is None:
        return [GradeResult(None, False, "this grader needs a served model and the grading worker has none")] * len(
            gradable
        )
    try:
        return grade_items(criterion, [(item.item, samples) for item, samples, _api in gradable], model_grader=judge)
    except Exception as exc:
        logger.exception("grader %s raised", criterion.name)
        return [GradeResult(None, False, f"the grader raised {type(exc).__name__}: {exc}")] * len(gradable)


def _response_error(response: dict[str, Any]) -> dict[str, Any]:
    """``{code, message}`` of a line's non-200 response (OpenAI's error envelope in its body)."""
    error = ((response.get("body") or {}).get("error")) or {}
    return {"code": error.get("code") or "request_failed", "message": error.get("message") or "the request failed"}
