"""Validate a batch input file's structure (UTF-8 JSONL) before any work runs: all lines good, or every error.

Only the file's structure fails a batch. A body the endpoint rejects (an empty prompt, a field out of
range, ``stream: true``, an unknown field) is not checked here: the worker parses each line's body
with its endpoint's schema (`jobs.line_body.parse_body`) and answers a bad one with a 400 for that
line alone, as OpenAI does.

Each bad line yields exactly one `LineError` (the first problem found, checked in this order):

| code | meaning |
|---|---|
| ``invalid_json`` | not a JSON object (``NaN``/``Infinity`` are not JSON), or nested over 64 levels (`jobs.nesting`) |
| ``missing_custom_id`` | ``custom_id`` absent, not a string, or empty |
| ``invalid_custom_id`` | ``custom_id`` longer than 512 characters |
| ``duplicate_custom_id`` | ``custom_id`` already used by an earlier line |
| ``invalid_line`` | a top-level key other than custom_id, method, url, body |
| ``invalid_method`` | ``method`` is not ``"POST"`` |
| ``invalid_url`` | ``url`` differs from the batch's endpoint |
| ``invalid_body`` | ``body`` is not an object |
| ``invalid_body`` | ``body.model`` is missing or not a string |
| ``mismatched_model`` | ``body.model`` names another served model than an earlier line (one model per file; aliases count as their model) |

Whole-file problems have ``line = None``: ``file_too_large`` (over ``max_file_bytes``),
``empty_file`` (no non-blank line), ``too_many_lines`` (over ``max_file_lines`` non-blank lines).
A file that is not UTF-8 text is one ``invalid_encoding`` error naming the line of its first bad byte
(a binary file would otherwise give an error per line). At most `MAX_ERRORS` errors are kept, the
first ones; `ValidationResult.num_errors` counts them all. Line numbers are 1-based physical lines;
blank lines are skipped but counted; a UTF-8 BOM and CRLF line ends are accepted.

A ``custom_id`` that PostgreSQL cannot hold (a NUL character, a lone surrogate; `jobs.storable_text`)
does not fail the file: the line is kept with a `ValidatedLine.rejection` and answered with its own
400 naming ``custom_id``, while the other lines run (`jobs.repository.apply_validation`). So is a
``body.model`` that no configured model has (name or alias): a 400 ``model_not_found`` naming the
served models, for that line alone. The file's model (`ValidationResult.model`) is the model its
served lines name, which routes the batch to that model's workers (`jobs.shards`).

The file arrives as chunks and is read once per pass, line by line, so memory holds one line, the
``custom_id`` set and the errors, never the file: `validate_batch_file` checks it, then
`validated_lines` reads it again for the lines to store. `limit_lines` counts lines on the way in
(uploads, docs/api.md "Limits").
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from jobs.nesting import MAX_JSON_DEPTH, too_deep
from jobs.schemas import MAX_CUSTOM_ID_CHARS, LineError
from jobs.storable_text import escaped, unstorable_reason

MAX_ERRORS = 1000
"""Most errors a `ValidationResult` keeps (the first ones; `ValidationResult.num_errors` counts all)."""

_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
_TOO_DEEP = f"the line nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(slots=True)
class ValidatedLine:
    """A line whose structure passed every check: its 1-based line number, ``custom_id`` and raw ``body``.

    ``rejection``: why the line is answered with a 400 instead of running (its ``custom_id`` cannot be
    stored, ``param`` "custom_id"; or its model is not served, ``param`` "body.model"), or None.
    ``model``: the served model ``body.model`` names (an alias resolved), None when not served.
    """

    line_number: int
    custom_id: str
    body: dict[str, Any]
    rejection: LineError | None = None
    model: str | None = None


@dataclass(slots=True)
class ValidationResult:
    """``errors``: the first `MAX_ERRORS` errors (empty when the file is good); ``num_errors``: all of
    them; ``num_lines``: the non-blank lines read; ``model``: the served model the lines name (None
    when no line names one)."""

    errors: list[LineError] = field(default_factory=list)
    num_errors: int = 0
    num_lines: int = 0
    model: str | None = None

    @property
    def ok(self) -> bool:
        return not self.num_errors

    def add(self, error: LineError) -> None:
        """Count ``error``; keep it while fewer than `MAX_ERRORS` are kept."""
        self.num_errors += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)


class TooManyLines(ValueError):
    """A file has more than ``max_lines`` non-blank lines (`limit_lines`)."""

    def __init__(self, max_lines: int) -> None:
        super().__init__(f"the file has more than the limit of {max_lines} requests (non-blank lines)")
        self.max_lines = max_lines


class _LineProblem(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class _FileTooLarge(Exception):
    pass


class _NotUtf8(Exception):
    def __init__(self, byte_index: int) -> None:
        super().__init__(byte_index)
        self.byte_index = byte_index


def numbered_lines(chunks: Iterable[bytes], *, max_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of a file given as chunks, with their 1-based physical line numbers.

    A leading UTF-8 BOM is dropped; a line keeps its ``\\r`` (JSON ignores it). Holds one line at a time.
    """
    pending = b""
    line_number = 0
    num_bytes = 0
    first = True
    for chunk in chunks:
        num_bytes += len(chunk)
        if max_bytes is not None and num_bytes > max_bytes:
            raise _FileTooLarge
        if first:
            chunk, first = chunk.removeprefix(_UTF8_BOM), False
        pieces = (pending + chunk).split(b"\n")
        pending = pieces.pop()
        for raw in pieces:
            line_number += 1
            if raw.strip():
                yield line_number, raw
    if pending.strip():
        yield line_number + 1, pending


def limit_lines(chunks: Iterable[bytes], max_lines: int) -> Iterator[bytes]:
    """``chunks`` unchanged, counting non-blank lines as they pass (one flag of state, no line held).

    Raises:
        TooManyLines: the count went over ``max_lines`` (raised when that line's end arrives).
    """
    count = 0
    in_line = False  # the current, unfinished line has a non-blank byte
    for chunk in chunks:
        pieces = chunk.split(b"\n")
        for piece in pieces[:-1]:
            if in_line or piece.strip():
                count += 1
                if count > max_lines:
                    raise TooManyLines(max_lines)
            in_line = False
        in_line = in_line or bool(pieces[-1].strip().removeprefix(_UTF8_BOM))
        yield chunk
    if in_line and count + 1 > max_lines:
        raise TooManyLines(max_lines)


def validate_batch_file(
    chunks: Iterable[bytes],
    *,
    endpoint: str,
    model_names: Collection[str] | Mapping[str, str],
    max_lines: int,
    max_bytes: int,
) -> ValidationResult:
    """Check every line of a batch input file against the batch's endpoint and the served models.

    Args:
        chunks: the raw file bytes, in chunks (any sizes).
        endpoint: the batch's endpoint; every line's ``url`` must equal it.
        model_names: names accepted in ``body.model``: a mapping name or alias -> model name
            (`jobs.config.Settings.aliases`), or the names alone.
        max_lines: most non-blank lines allowed.
        max_bytes: largest file size allowed, in bytes.

    Returns:
        `ValidationResult`: no error and the line count, or one `LineError` per bad line (file
        order, the first `MAX_ERRORS` kept), or a single whole-file error (``invalid_encoding`` has the
        line of the first byte that is not UTF-8).
    """
    result = ValidationResult()
    first_line_of: dict[str, int] = {}
    first_line_of_model: dict[str, int] = {}
    try:
        for line_number, raw in numbered_lines(chunks, max_bytes=max_bytes):
            result.num_lines += 1
            if result.num_lines > max_lines:
                return _whole_file(
                    "too_many_lines", f"the file has more than {max_lines} requests; the limit is {max_lines}"
                )
            try:
                line = _validate_line(line_number, raw, endpoint, model_names, first_line_of)
                _check_one_model(line, result, first_line_of_model)
            except _LineProblem as problem:
                result.add(LineError(code=problem.code, message=problem.message, param=problem.param, line=line_number))
            except _NotUtf8 as exc:
                message = (
                    f"the file is not UTF-8 text: line {line_number} has a byte that is not valid UTF-8 "
                    f"(byte {exc.byte_index} of the line); a batch input file is UTF-8 JSONL"
                )
                return ValidationResult(
                    errors=[LineError(code="invalid_encoding", message=message, line=line_number)], num_errors=1
                )
    except _FileTooLarge:
        return _whole_file("file_too_large", f"the file is larger than the limit of {max_bytes} bytes")
    if not result.num_lines:
        return _whole_file("empty_file", "the file has no requests (it is empty or blank)")
    return result


def validated_lines(
    chunks: Iterable[bytes], *, endpoint: str, model_names: Collection[str] | Mapping[str, str]
) -> Iterator[ValidatedLine]:
    """The lines of a file `validate_batch_file` found good, in file order, one at a time.

    Raises:
        ValueError: a line fails a check after all (the file changed between the two passes).
    """
    first_line_of: dict[str, int] = {}
    for line_number, raw in numbered_lines(chunks):
        try:
            yield _validate_line(line_number, raw, endpoint, model_names, first_line_of)
        except _LineProblem as problem:
            raise ValueError(f"line {line_number} no longer validates: {problem.message}") from None
        except _NotUtf8:
            raise ValueError(f"line {line_number} no longer validates: it is not UTF-8") from None


def _whole_file(code: str, message: str) -> ValidationResult:
    return ValidationResult(errors=[LineError(code=code, message=message)], num_errors=1)


def _check_one_model(line: ValidatedLine, result: ValidationResult, first_line_of_model: dict[str, int]) -> None:
    """Note the line's served model as the file's; raise when an earlier line named another one."""
    if line.model is None:
        return
    first = first_line_of_model.setdefault(line.model, line.line_number)
    if result.model is None:
        result.model = line.model
    elif line.model != result.model:
        first = first_line_of_model[result.model]
        raise _LineProblem(
            "mismatched_model",
            f"body.model {line.body['model']!r} is model {line.model!r}, but line {first} names model "
            f"{result.model!r}: all lines of a batch's file must name the same model",
            "body.model",
        )


def _validate_line(
    line_number: int,
    raw: bytes,
    endpoint: str,
    model_names: Collection[str] | Mapping[str, str],
    first_line_of: dict[str, int],
) -> ValidatedLine:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _NotUtf8(exc.start) from None
    try:
        line = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise _LineProblem("invalid_json", _TOO_DEEP) from None
    except ValueError as exc:
        raise _LineProblem("invalid_json", f"the line is not valid JSON: {exc}") from None
    if too_deep(line, text=text):
        raise _LineProblem("invalid_json", _TOO_DEEP)
    if not isinstance(line, dict):
        raise _LineProblem("invalid_json", f"the line must be a JSON object, got {_json_type(line)}")

    rejection = _check_custom_id(line, line_number, first_line_of)
    unknown = sorted(set(line) - _LINE_KEYS)
    if unknown:
        raise _LineProblem(
            "invalid_line",
            f"unknown field {unknown[0]!r} (a line has custom_id, method, url, body)",
            escaped(unknown[0]),
        )
    if "method" not in line:
        raise _LineProblem("invalid_method", "method is missing; it must be 'POST'", "method")
    if line["method"] != "POST":
        raise _LineProblem("invalid_method", f"method must be 'POST', got {line['method']!r}", "method")
    if "url" not in line:
        raise _LineProblem("invalid_url", f"url is missing; it must be the batch endpoint {endpoint!r}", "url")
    if line["url"] != endpoint:
        raise _LineProblem("invalid_url", f"url {line['url']!r} does not match the batch endpoint {endpoint!r}", "url")
    if not isinstance(line.get("body"), dict):
        raise _LineProblem("invalid_body", "body must be a JSON object", "body")
    model, model_rejection = _check_model(line["body"], model_names, line_number)
    # NOTE: no pydantic model here: it refuses a lone surrogate (string_unicode), which must reach the
    # custom_id rejection above or the body's own 400 (`jobs.line_body.parse_body`) instead.
    return ValidatedLine(
        line_number=line_number,
        custom_id=line["custom_id"],
        body=line["body"],
        rejection=rejection or model_rejection,
        model=model,
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _check_custom_id(line: dict[str, Any], line_number: int, first_line_of: dict[str, int]) -> LineError | None:
    """Raise the line's custom_id problem; return the line's rejection when its custom_id cannot be stored."""
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
    reason = unstorable_reason(custom_id)
    if reason is None:
        return None
    message = f'custom_id "{escaped(custom_id)}" {reason}, which the service cannot store; this line was not run'
    return LineError(code="invalid_value", message=message, param="custom_id", line=line_number)


def _check_model(
    body: dict[str, Any], model_names: Collection[str] | Mapping[str, str], line_number: int
) -> tuple[str | None, LineError | None]:
    """The served model ``body.model`` names, or None and the line's 400 when no model has that name."""
    model = body.get("model")
    if not isinstance(model, str):
        raise _LineProblem("invalid_body", "body.model is required and must be a string", "body.model")
    resolved = model_names.get(model) if isinstance(model_names, Mapping) else (model if model in model_names else None)
    if resolved is not None:
        return resolved, None
    served = ", ".join(
        repr(name) for name in sorted(set(model_names.values() if isinstance(model_names, Mapping) else model_names))
    )
    message = f'model "{escaped(model)}" is not served here (served: {served}); this line was not run'
    return None, LineError(code="model_not_found", message=message, param="body.model", line=line_number)


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
