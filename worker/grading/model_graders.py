"""``score_model`` and ``label_model``: a served model grades through structured outputs.

The grader's ``input`` messages are rendered (``{{item.x}}``, ``{{sample.output_text}}``) and sent with a
``response_format`` of type ``json_schema`` (strict), so the engine's grammar (worker/engine/
structured_output) can only produce ``{"score": <number in range>}`` or ``{"label": <one of labels>}``.
The answer is still checked after parsing: a reply cut short by the token limit is not JSON, and
neither the range nor the label set is left to trust.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from jobs.evals.criteria import LabelModelCriterion, ScoreModelCriterion
from jobs.evals.templates import render

# NOTE: graders answer with one short JSON object; the cap bounds a model that pads it with whitespace.
DEFAULT_MAX_COMPLETION_TOKENS = 128


class ModelGrader(Protocol):
    """A served model answering one chat conversation."""

    def generate(
        self, messages: list[dict[str, Any]], *, response_format: dict[str, Any] | None, sampling_params: dict[str, Any]
    ) -> str:
        """The assistant's reply text to ``messages`` (``[{"role", "content": str}]``).

        ``response_format``: chat's ``response_format`` (``{"type": "json_schema", "json_schema": ...}``);
        ``sampling_params``: chat body fields (``temperature``, ``top_p``, ``seed``, ``max_completion_tokens``).
        """
        ...


class GraderOutputError(ValueError):
    """The grader model's reply is not the JSON object asked for (cut short, or out of range)."""


def render_messages(
    criterion: ScoreModelCriterion | LabelModelCriterion, *, item: dict[str, Any], sample: dict[str, Any]
) -> list[dict[str, Any]]:
    """The criterion's ``input`` as chat messages, templates rendered (text parts joined).

    Raises:
        jobs.evals.templates.TemplateError: a template names a field the item or sample lacks.
    """
    return [
        {
            "role": message.role,
            "content": "".join(render(text, item=item, sample=sample) for text in message.content_templates()),
        }
        for message in criterion.input
    ]


def score_response_format(low: float, high: float) -> dict[str, Any]:
    """A strict json_schema ``response_format`` for ``{"score": number}`` with ``low <= score <= high``."""
    schema = {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": low, "maximum": high}},
        "required": ["score"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "score", "strict": True, "schema": schema}}


def label_response_format(labels: list[str]) -> dict[str, Any]:
    """A strict json_schema ``response_format`` for ``{"label": one of labels}``."""
    schema = {
        "type": "object",
        "properties": {"label": {"type": "string", "enum": list(labels)}},
        "required": ["label"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "label", "strict": True, "schema": schema}}


def _sampling_params(criterion: ScoreModelCriterion | LabelModelCriterion) -> dict[str, Any]:
    # NOTE: a grader should be repeatable, so temperature defaults to 0 (greedy) here, not the API's 1.
    params: dict[str, Any] = {"temperature": 0.0, "max_completion_tokens": DEFAULT_MAX_COMPLETION_TOKENS}
    given = criterion.sampling_params if isinstance(criterion, ScoreModelCriterion) else None
    if given is not None:
        if given.temperature is not None:
            params["temperature"] = given.temperature
        if given.top_p is not None:
            params["top_p"] = given.top_p
        if given.seed is not None:
            params["seed"] = given.seed
        if given.max_completions_tokens is not None:
            params["max_completion_tokens"] = given.max_completions_tokens
    return params


def _answer(reply: str, key: str) -> Any:
    try:
        answer = json.loads(reply)
    except ValueError:
        raise GraderOutputError(f"the grader model's reply is not JSON (cut short?): {reply[:200]!r}") from None
    if not isinstance(answer, dict) or key not in answer:
        raise GraderOutputError(f"the grader model's reply has no {key!r}: {reply[:200]!r}")
    return answer[key]


def model_score(
    criterion: ScoreModelCriterion, grader: ModelGrader, *, item: dict[str, Any], sample: dict[str, Any]
) -> float:
    """The grader model's score of ``sample``.

    Raises:
        TemplateError: as `render_messages`.
        GraderOutputError: the reply is not ``{"score": number}`` within the criterion's range.
    """
    low, high = criterion.score_range
    reply = grader.generate(
        render_messages(criterion, item=item, sample=sample),
        response_format=score_response_format(low, high),
        sampling_params=_sampling_params(criterion),
    )
    score = _answer(reply, "score")
    if isinstance(score, bool) or not isinstance(score, int | float) or not low <= score <= high:
        raise GraderOutputError(f"the grader model's score {score!r} is not a number in [{low}, {high}]")
    return float(score)


def model_label(
    criterion: LabelModelCriterion, grader: ModelGrader, *, item: dict[str, Any], sample: dict[str, Any]
) -> str:
    """The label the grader model gives ``sample``, one of ``criterion.labels``.

    Raises:
        TemplateError: as `render_messages`.
        GraderOutputError: the reply is not ``{"label": one of labels}``.
    """
    reply = grader.generate(
        render_messages(criterion, item=item, sample=sample),
        response_format=label_response_format(criterion.labels),
        sampling_params=_sampling_params(criterion),
    )
    label = _answer(reply, "label")
    if label not in criterion.labels:
        raise GraderOutputError(f"the grader model's label {label!r} is not one of {criterion.labels}")
    return str(label)
