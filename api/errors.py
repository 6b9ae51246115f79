"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

| raised | status | ``type`` / ``code`` |
|---|---|---|
| `jobs.errors.InvalidRequest`, bad request fields, unknown ``after`` cursor | 400 | invalid_request_error / the error's code |
| `jobs.errors.NotFound`, unknown route | 404 | invalid_request_error / ``{kind}_not_found`` |
| `jobs.status.IllegalTransition` (e.g. cancel a completed batch) | 409 | invalid_request_error / ``invalid_status`` |
| the database does not answer (``sqlalchemy.exc.OperationalError``) | 503 | server_error / ``database_unavailable`` |
| anything else | 500 | server_error |
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobs.errors import InvalidRequest, NotFound, error_envelope
from jobs.paging import UnknownCursor
from jobs.status import IllegalTransition

logger = logging.getLogger(__name__)


def error_response(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    error_type: str = "invalid_request_error",
) -> JSONResponse:
    """A JSON response with OpenAI's error envelope."""
    return JSONResponse(
        status_code=status_code, content=error_envelope(message, type=error_type, param=param, code=code)
    )


def _invalid_request(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequest)
    return error_response(400, exc.message, param=exc.param, code=exc.code)


def _not_found(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, NotFound)
    return error_response(404, str(exc), code=f"{exc.kind.replace(' ', '_')}_not_found")


def _illegal_transition(_request: Request, exc: Exception) -> JSONResponse:
    return error_response(409, str(exc), code="invalid_status")


def _unknown_cursor(_request: Request, exc: Exception) -> JSONResponse:
    return error_response(400, str(exc), param="after", code="invalid_value")


def _request_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors: list[dict[str, Any]] = list(exc.errors())
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    # NOTE: drop the location kind ("body", "query", "path", "form") OpenAI's param does not carry.
    loc = [str(part) for part in first["loc"][1:]] if len(first["loc"]) > 1 else [str(p) for p in first["loc"]]
    param = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:]) or 'request'}: {err['msg']}" for err in errors)
    return error_response(400, message, param=param, code="invalid_value")


def _http_exception(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = "not_found" if exc.status_code == 404 else None
    return error_response(exc.status_code, str(exc.detail), code=code)


def _database_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OperationalError)
    logger.warning("database unreachable: %s", exc.orig or exc)
    return error_response(
        503,
        f"the database is unreachable ({exc.orig or exc}); retry later",
        error_type="server_error",
        code="database_unavailable",
    )


def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal server error", error_type="server_error", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Register every handler above on ``app``."""
    app.add_exception_handler(InvalidRequest, _invalid_request)
    app.add_exception_handler(NotFound, _not_found)
    app.add_exception_handler(IllegalTransition, _illegal_transition)
    app.add_exception_handler(UnknownCursor, _unknown_cursor)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(OperationalError, _database_unavailable)
    app.add_exception_handler(Exception, _unexpected)
