"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

| raised | status | ``type`` / ``code`` |
|---|---|---|
| `jobs.errors.InvalidRequest`, bad request fields, unknown ``after`` cursor | 400 | invalid_request_error / the error's code |
| `api.auth.Unauthorized` (keys exist; none, a wrong or a revoked one sent) | 401 | invalid_request_error / ``invalid_api_key`` |
| `jobs.errors.NotFound`, unknown route | 404 | invalid_request_error / ``{kind}_not_found`` |
| a method the route does not take | 405 | invalid_request_error / ``method_not_allowed`` |
| `jobs.status.IllegalTransition` (e.g. cancel a completed batch) | 409 | invalid_request_error / ``invalid_status`` |
| `jobs.errors.Conflict` (e.g. delete a file a schedule uses) | 409 | invalid_request_error / the error's code |
| a request body not received in time (`api.limits.RequestBodies`) | 408 | invalid_request_error / ``request_timeout`` |
| `UploadTooLarge`, a request body over the size limit | 413 | invalid_request_error / ``file_too_large`` or ``too_many_lines`` |
| a non-upload body over ``max_request_body_bytes`` (`api.limits`) | 413 | invalid_request_error / ``request_too_large`` |
| `api.rate_limits.RateLimited` (``Retry-After``) | 429 | ``requests`` / ``rate_limit_exceeded``; ``tokens`` / ``token_limit_exceeded`` |
| SQLAlchemy's ``OperationalError`` or ``InterfaceError`` (the database is unreachable) | 503 | server_error / ``database_unavailable`` |
| anything else | 500 | server_error |
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.auth import Unauthorized
from api.rate_limits import RateLimited
from jobs.errors import Conflict, InvalidRequest, NotFound, error_envelope
from jobs.paging import UnknownCursor
from jobs.status import IllegalTransition
from jobs.storable_text import escaped

logger = logging.getLogger(__name__)


def error_response(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    error_type: str = "invalid_request_error",
) -> JSONResponse:
    """A JSON response with OpenAI's error envelope; a NUL or lone surrogate from the request (a field
    name in ``param``) is written as its JSON escape (`jobs.storable_text.escaped`)."""
    content = error_envelope(
        escaped(message), type=error_type, param=None if param is None else escaped(param), code=code
    )
    return JSONResponse(status_code=status_code, content=content)


class UploadTooLarge(Exception):
    """An upload over a limit (a 413): ``code`` ``file_too_large`` or ``too_many_lines``; the message names it."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def too_large_message(max_file_bytes: int) -> str:
    """The 413 message of an upload over ``max_file_bytes`` (``BATCHINFER_MAX_FILE_BYTES``)."""
    return f"the file is larger than the limit of {max_file_bytes} bytes (BATCHINFER_MAX_FILE_BYTES)"


def _invalid_request(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequest)
    return error_response(400, exc.message, param=exc.param, code=exc.code)


def _not_found(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, NotFound)
    return error_response(404, str(exc), code=f"{exc.kind.replace(' ', '_')}_not_found")


def _illegal_transition(_request: Request, exc: Exception) -> JSONResponse:
    return error_response(409, str(exc), code="invalid_status")


def _conflict(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Conflict)
    return error_response(409, exc.message, code=exc.code)


def _unknown_cursor(_request: Request, exc: Exception) -> JSONResponse:
    return error_response(400, str(exc), param="after", code="invalid_value")


def _request_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors: list[dict[str, Any]] = list(exc.errors())
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # its loc is ("body", character position), not a field
        reason = (first.get("ctx") or {}).get("error", first["msg"])
        message = f"the request body is not valid JSON: {reason} (character {first['loc'][-1]})"
        return error_response(400, message, code="invalid_json")
    # NOTE: drop the location kind ("body", "query", "path", "form") OpenAI's param does not carry.
    loc = [str(part) for part in first["loc"][1:]] if len(first["loc"]) > 1 else [str(p) for p in first["loc"]]
    param = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:]) or 'request'}: {err['msg']}" for err in errors)
    return error_response(400, message, param=param, code="invalid_value")


def unauthorized_response(exc: Unauthorized) -> JSONResponse:
    """The 401 ``invalid_api_key`` of ``exc``, with the ``WWW-Authenticate`` challenge."""
    response = error_response(401, exc.message, code="invalid_api_key")
    # NOTE: a browser on /ui prompts for credentials on this header; the key goes in the password field.
    response.headers["WWW-Authenticate"] = 'Basic realm="batchinfer"' if exc.browser else "Bearer"
    return response


def rate_limited_response(exc: RateLimited) -> JSONResponse:
    """The 429 of ``exc``, with ``Retry-After`` (whole seconds)."""
    response = error_response(429, exc.message, code=exc.code, error_type=exc.error_type)
    response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


def _unauthorized(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Unauthorized)
    return unauthorized_response(exc)


def _rate_limited(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RateLimited)
    return rate_limited_response(exc)


def _upload_too_large(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, UploadTooLarge)
    return error_response(413, exc.message, param="file", code=exc.code)


def _database_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    return database_unavailable_response(exc)


def database_unavailable_response(exc: Exception) -> JSONResponse:
    """The 503 ``database_unavailable`` of a SQLAlchemy ``OperationalError`` / ``InterfaceError``, naming the reason."""
    logger.warning("the database is unreachable: %s", exc)
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    return error_response(
        503,
        f"the database is unavailable; try again later ({reason})",
        error_type="server_error",
        code="database_unavailable",
    )


def _http_exception(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, str(exc.detail), code=code)


def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal server error", error_type="server_error", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Register every handler above on ``app``."""
    app.add_exception_handler(InvalidRequest, _invalid_request)
    app.add_exception_handler(NotFound, _not_found)
    app.add_exception_handler(Unauthorized, _unauthorized)
    app.add_exception_handler(UploadTooLarge, _upload_too_large)
    app.add_exception_handler(RateLimited, _rate_limited)
    app.add_exception_handler(OperationalError, _database_unavailable)
    app.add_exception_handler(InterfaceError, _database_unavailable)
    app.add_exception_handler(IllegalTransition, _illegal_transition)
    app.add_exception_handler(Conflict, _conflict)
    app.add_exception_handler(UnknownCursor, _unknown_cursor)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected)
