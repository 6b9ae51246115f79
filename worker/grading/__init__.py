"""Grade one data item's samples with one testing criterion (`jobs.evals.criteria`).

``grade_items`` (``grade_item`` over a shard's items) is the entry point the grading task calls; a grader that fails on an item returns an
error for that item instead of raising.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobs.evals.criteria import TestingCriterion
from jobs.evals.templates import TemplateError, render


class ModelGrader(Protocol):
    """A served model that model graders ask: ``messages`` in, the answer's text out."""

    def generate(
        self, messages: list[dict[str, Any]], *, response_format: dict[str, Any] | None, sampling_params: dict[str, Any]
    ) -> str: ...


@dataclass(slots=True)
class GradeResult:
    """One criterion on one item: ``score`` (None on error), ``passed``, ``error`` (why it could not
    be graded) and extra ``metrics`` (e.g. ``pass@k``)."""

    score: float | None
    passed: bool
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def grade_item(
    criterion: TestingCriterion,
    *,
    item: dict[str, Any],
    samples: list[dict[str, Any]],
    model_grader: ModelGrader | None = None,
) -> GradeResult:
    """Grade ``samples`` (the Evals API sample, ``{output_text, choices, model, usage}``; the first one
    is graded) of ``item`` with ``criterion``; a template naming an absent field is the item's error."""
    sample = samples[0] if samples else None
    try:
        given = render(criterion.input, item=item, sample=sample)
        reference = render(criterion.reference, item=item, sample=sample)
    except TemplateError as exc:
        return GradeResult(score=None, passed=False, error=str(exc))
    if criterion.operation == "eq":
        passed = given == reference
    elif criterion.operation == "ne":
        passed = given != reference
    elif criterion.operation == "like":
        passed = reference in given
    else:
        passed = reference.lower() in given.lower()
    return GradeResult(score=1.0 if passed else 0.0, passed=passed)


def grade_items(
    criterion: TestingCriterion,
    items: Sequence[tuple[dict[str, Any], list[dict[str, Any]]]],
    *,
    model_grader: ModelGrader | None = None,
) -> list[GradeResult]:
    """`grade_item` over ``(item, samples)`` pairs, results in the same order."""
    return [grade_item(criterion, item=item, samples=samples, model_grader=model_grader) for item, samples in items]
