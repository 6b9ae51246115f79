"""`worker.eval_grading`: a shard's items graded criterion by criterion; failures stay per item."""

from __future__ import annotations

from typing import Any

import pytest

from jobs.evals.criteria import parse_testing_criteria
from jobs.evals.data_sources import parse_data_source
from jobs.evals.repository import ERROR, FAIL, PASS, ItemToGrade
from worker import eval_grading

CHECK = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.a}}"}
DATA_SOURCE = parse_data_source(
    {
        "type": "completions",
        "source": {"type": "file_content", "content": [{"item": {}}]},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.q}}"}]},
    },
    item_schema={"type": "object"},
    served_model="m",
)


def _item(item_id: str, answer: str | None, *, expected: str = "yes") -> ItemToGrade:
    if answer is None:
        error = {"code": "context_length_exceeded", "message": "too long"}
        return ItemToGrade(item_id, {"a": expected}, None, {"messages": []}, "failed", None, error)
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}
    response = {"status_code": 200, "body": {"model": "m", "choices": [choice], "usage": {}}}
    return ItemToGrade(item_id, {"a": expected}, None, {"messages": []}, "completed", response, None)


def test_items_pass_fail_or_carry_their_lines_error() -> None:
    criteria = parse_testing_criteria(
        [{**CHECK, "operation": "eq"}, {**CHECK, "name": "any", "operation": "ne", "reference": "!"}]
    )
    grades = eval_grading._grade([_item("a", "yes"), _item("b", "no"), _item("c", None)], criteria, DATA_SOURCE, None)
    by_id = {grade.item_id: grade for grade in grades}
    assert (by_id["a"].status, by_id["a"].criteria_passed) == (PASS, [True, True])
    assert (by_id["b"].status, by_id["b"].criteria_passed) == (FAIL, [False, True])
    assert by_id["b"].sample is not None and by_id["b"].sample["output"] == [{"role": "assistant", "content": "no"}]
    assert (by_id["c"].status, by_id["c"].criteria_passed) == (ERROR, [None, None])
    assert by_id["c"].error == {"code": "context_length_exceeded", "message": "too long"}


def test_a_grader_that_raises_errors_its_items_not_the_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(eval_grading, "grade_items", broken)
    criteria = parse_testing_criteria([{**CHECK, "operation": "eq"}])
    (grade,) = eval_grading._grade([_item("a", "yes")], criteria, DATA_SOURCE, None)
    assert grade.status == ERROR and grade.criteria_passed == [None]
    assert grade.results[0]["error"] == "the grader raised ZeroDivisionError: bug"
