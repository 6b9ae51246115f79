"""Validate a batch input file's structure (UTF-8 JSONL) before any work runs: all lines good, or every error.

Only the file's structure fails a batch. A body the endpoint rejects (an empty prompt, a field out of
range, ``stream: true``, an unknown field) is not checked here: the worker parses each line's body
with its endpoint's schema (`jobs.line_body.parse_body`) and answers a bad one with a 400 for that
line alone, as OpenAI does.

Each bad line yields exactly one `LineError` (the first problem found, checked in this order):

| code | meaning |
|---|---|
| ``invalid_encoding`` | the line is not valid UTF-8 |
| ``invalid_json`` | the line is not a JSON object (``NaN``/``Infinity`` are not JSON) |
| ``missing_custom_id`` | ``custom_id`` absent, not a string, or empty |
| ``invalid_custom_id`` | ``custom_id`` longer than 512 characters |
| ``duplicate_custom_id`` | ``custom_id`` already used by an earlier line |
| ``invalid_line`` | a top-level key other than custom_id, method, url, body |
| ``invalid_method`` | ``method`` is not ``"POST"`` |
| ``invalid_url`` | ``url`` differs from the batch's endpoint |
| ``invalid_body`` | ``body`` is not an object |
| ``invalid_body`` | ``body.model`` is missing or not a string |
| ``model_not_found`` | ``body.model`` is not the served model |

Whole-file problems have ``line = None``: ``file_too_large`` (over ``max_file_bytes``),
``empty_file`` (no non-blank line), ``too_many_lines`` (over ``max_file_lines`` non-blank lines).
Line numbers are 1-based physical lines; blank lines are skipped but counted; a UTF-8 BOM and
CRLF line ends are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from jobs.schemas import MAX_CUSTOM_ID_CHARS, BatchLine, LineError

_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(slots=True)
class ValidatedLine:
    """A line that passed every check: its 1-based line number, ``custom_id`` and raw ``body``."""

    line_number: int
    custom_id: str
    body: dict[str, Any]


@dataclass(slots=True)
class ValidationResult:
    """Either ``lines`` (all good, in file order) or ``errors`` (at least one); never both used."""

    lines: list[ValidatedLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


class _LineProblem(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def validate_batch_file(
    data: bytes,
    *,
    endpoint: str,
    model_names: Collection[str],
    max_lines: int,
    max_bytes: int,
) -> ValidationResult:
    """Check every line of a batch input file against the batch's endpoint and the served model.

    Args:
        data: the raw file bytes.
        endpoint: the batch's endpoint; every line's ``url`` must equal it.
        model_names: names accepted in ``body.model``.
        max_lines: most non-blank lines allowed.
        max_bytes: largest file size allowed, in bytes.

    Returns:
        `ValidationResult`: the validated lines, or one `LineError` per bad line (file order).
    """
    if len(data) > max_bytes:
        return _whole_file("file_too_large", f"the file is {len(data)} bytes; the limit is {max_bytes} bytes")
    raw_lines = data.removeprefix(_UTF8_BOM).split(b"\n")
    numbered = [(idx, raw) for idx, raw in enumerate(raw_lines, start=1) if raw.strip()]
    if not numbered:
        return _whole_file("empty_file", "the file has no requests (it is empty or blank)")
    if len(numbered) > max_lines:
        return _whole_file("too_many_lines", f"the file has {len(numbered)} requests; the limit is {max_lines}")

    result = ValidationResult()
    first_line_of: dict[str, int] = {}
    for line_number, raw in numbered:
        try:
            result.lines.append(_validate_line(line_number, raw, endpoint, model_names, first_line_of))
        except _LineProblem as problem:
            result.errors.append(
                LineError(code=problem.code, message=problem.message, param=problem.param, line=line_number)
            )
    if result.errors:
        result.lines.clear()
    return result


def _whole_file(code: str, message: str) -> ValidationResult:
    return ValidationResult(errors=[LineError(code=code, message=message)])


def _validate_line(
    line_number: int, raw: bytes, endpoint: str, model_names: Collection[str], first_line_of: dict[str, int]
) -> ValidatedLine:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _LineProblem("invalid_encoding", f"the line is not valid UTF-8 (byte {exc.start})") from None
    try:
        line = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise _LineProblem("invalid_json", f"the line is not valid JSON: {exc}") from None
    if not isinstance(line, dict):
        raise _LineProblem("invalid_json", f"the line must be a JSON object, got {_json_type(line)}")

    _check_custom_id(line, line_number, first_line_of)
    unknown = sorted(set(line) - _LINE_KEYS)
    if unknown:
        raise _LineProblem(
            "invalid_line", f"unknown field {unknown[0]!r} (a line has custom_id, method, url, body)", unknown[0]
        )
    if line.get("method") != "POST":
        raise _LineProblem("invalid_method", f"method must be 'POST', got {line.get('method')!r}", "method")
    if line.get("url") != endpoint:
        raise _LineProblem(
            "invalid_url", f"url {line.get('url')!r} does not match the batch endpoint {endpoint!r}", "url"
        )
    if not isinstance(line.get("body"), dict):
        raise _LineProblem("invalid_body", "body must be a JSON object", "body")
    _check_model(line["body"], model_names)
    parsed = BatchLine.model_validate(line)
    return ValidatedLine(line_number=line_number, custom_id=parsed.custom_id, body=parsed.body)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _check_custom_id(line: dict[str, Any], line_number: int, first_line_of: dict[str, int]) -> None:
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineProblem("missing_custom_id", "custom_id is required and must be a non-empty string", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise _LineProblem(
            "invalid_custom_id", f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters", "custom_id"
        )
    first = first_line_of.setdefault(custom_id, line_number)
    if first != line_number:
        raise _LineProblem(
            "duplicate_custom_id", f"custom_id {custom_id!r} is already used on line {first}", "custom_id"
        )


def _check_model(body: dict[str, Any], model_names: Collection[str]) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise _LineProblem("invalid_body", "body.model is required and must be a string", "body.model")
    if model not in model_names:
        served = ", ".join(repr(name) for name in sorted(model_names))
        raise _LineProblem("model_not_found", f"model {model!r} is not served here (served: {served})", "body.model")


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type (``null``, ``array``, ``string``...)."""
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
    }
    return names.get(type(value), type(value).__name__)
