"""Testing criteria (the Evals API's graders) parsed once at ``POST /v1/evals``.

Only ``string_check`` here; every other grader type is refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from jobs.evals.templates import TemplateError, referenced_fields


class CriteriaError(ValueError):
    """A testing criterion the service refuses; the message names ``testing_criteria[i].<field>``."""


class StringCheckGrader(BaseModel):
    """``{type: "string_check", name, input, reference, operation}``: ``input`` and ``reference`` are
    templates; ``eq``/``ne`` compare exactly, ``like`` is "contains", ``ilike`` "contains, ignoring case"."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["string_check"]
    name: str
    input: str
    reference: str
    operation: Literal["eq", "ne", "like", "ilike"]


TestingCriterion = StringCheckGrader
_GRADERS: dict[str, type[BaseModel]] = {"string_check": StringCheckGrader}


def parse_testing_criteria(raw: list[dict[str, Any]]) -> list[TestingCriterion]:
    """The criteria of an eval, in order.

    Raises:
        CriteriaError: not a list of objects, an unknown ``type``, a missing or bad field, or a
            template that does not parse; the message starts with ``testing_criteria[i].<field>``.
    """
    if not isinstance(raw, list):
        raise CriteriaError("testing_criteria: must be a list of graders")
    criteria: list[TestingCriterion] = []
    for index, entry in enumerate(raw):
        where = f"testing_criteria[{index}]"
        if not isinstance(entry, dict):
            raise CriteriaError(f"{where}: must be an object")
        grader = _GRADERS.get(str(entry.get("type")))
        if grader is None:
            raise CriteriaError(
                f"{where}.type: unknown grader type {entry.get('type')!r}; use one of {', '.join(_GRADERS)}"
            )
        try:
            criterion = StringCheckGrader.model_validate(entry)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise CriteriaError(f"{where}.{field}: {first['msg']}") from None
        for field in ("input", "reference"):
            try:
                referenced_fields(getattr(criterion, field))
            except TemplateError as exc:
                raise CriteriaError(f"{where}.{field}: {exc}") from None
        criteria.append(criterion)
    return criteria


def needs_model(criterion: TestingCriterion) -> bool:
    """Whether grading with ``criterion`` calls a served model (only a worker with an engine can)."""
    return False
