"""Parse one batch line's ``body`` with its endpoint's schema: the one place a body is judged.

The worker calls `parse_body` on each stored line before it runs; a body the endpoint rejects
becomes that line's 400 ``response`` (`rejected_response`: OpenAI's error envelope, ``param`` naming
the field), while the other lines run. The rules themselves live in the schemas (`jobs.schemas`);
text the service cannot store or tokenize (a NUL, a lone surrogate) is refused first
(`jobs.storable_text`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from jobs.errors import InvalidRequest, error_envelope
from jobs.nesting import MAX_JSON_DEPTH, too_deep
from jobs.schemas import BODY_SCHEMAS, RESPONSES, RESPONSES_NOT_SERVED, LineBody
from jobs.storable_text import first_unstorable

# The body sits one level below its line, which `jobs.validation` holds to MAX_JSON_DEPTH levels.
_MAX_BODY_DEPTH = MAX_JSON_DEPTH - 1
_TOO_DEEP = f"the body nests arrays and objects more than {_MAX_BODY_DEPTH} levels deep"


def parse_body(endpoint: str, body: Mapping[str, Any]) -> LineBody:
    """The body parsed by ``endpoint``'s schema.

    Raises:
        InvalidRequest: the endpoint is not served (``param`` "url"); a string or a key in the body
            holds a NUL character or a lone surrogate (``param`` names it); the body nests arrays and
            objects too deeply (no ``param``); or the body breaks a rule of its schema: ``param`` is the
            first field at fault (``messages[0].content`` style), ``message`` names every problem in
            plain words.
    """
    schema = BODY_SCHEMAS.get(endpoint)
    if schema is None:
        raise InvalidRequest(f"unsupported endpoint {endpoint!r}; use one of {sorted(BODY_SCHEMAS)}", param="url")
    unstorable = first_unstorable(body)
    if unstorable is not None:
        param, reason = unstorable
        raise InvalidRequest(f"{param}: {reason}, which a request cannot hold", param=param)
    if too_deep(body, max_depth=_MAX_BODY_DEPTH):
        raise InvalidRequest(_TOO_DEEP)
    try:
        return schema.model_validate(body)
    except RecursionError:
        raise InvalidRequest(_TOO_DEEP) from None
    except ValidationError as exc:
        problems = [(_param(error), _describe(error, endpoint)) for error in exc.errors()]
        message = "; ".join(dict.fromkeys(f"{param}: {text}" if param else text for param, text in problems))
        raise InvalidRequest(message, param=problems[0][0]) from None


def new_request_id() -> str:
    """The id of one HTTP-like request inside a batch (``response.request_id``)."""
    return f"req_{uuid.uuid4().hex}"


def rejected_response(line_number: int, message: str, *, param: str | None, code: str | None = None) -> dict[str, Any]:
    """The stored ``response`` of a line refused with a 400 (``{status_code, request_id, body}``, the
    body OpenAI's error envelope); the message names the line."""
    body = error_envelope(f"line {line_number}: {message}", type="invalid_request_error", param=param, code=code)
    return {"status_code": 400, "request_id": new_request_id(), "body": body}


def _param(error: ErrorDetails) -> str | None:
    """OpenAI's ``param`` for an error location: ``messages[0].content``, ``logit_bias.42``; a model-level
    check names its field in ``ctx["param"]``, below the model's own location
    (``response_format.json_schema``)."""
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    field = error.get("ctx", {}).get("param")
    if field is not None:
        path += f".{field}"
    return path.lstrip(".") or None


def _describe(error: ErrorDetails, endpoint: str) -> str:
    if error["type"] == "extra_forbidden":
        if endpoint == RESPONSES and error["loc"] and error["loc"][0] in RESPONSES_NOT_SERVED:
            return f"unknown field (not served on {endpoint}: it answers text with text, without tools or state)"
        return f"unknown field (not a parameter of {endpoint})"
    if error["type"] == "missing":
        return "is required"
    # NOTE: pydantic words constraints as "Input should be ..." and custom checks as "Value error, ...".
    return error["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
