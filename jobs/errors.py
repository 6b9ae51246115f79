"""Domain errors the API and the worker turn into OpenAI-style error responses, and that envelope."""

from __future__ import annotations

from typing import Any


class NotFound(LookupError):
    """No such object (a 404): ``kind`` is "file" or "batch", ``object_id`` the id asked for."""

    def __init__(self, kind: str, object_id: str) -> None:
        super().__init__(f"no {kind} with id {object_id!r}")
        self.kind = kind
        self.object_id = object_id


class InvalidRequest(ValueError):
    """A request the service refuses (a 400): an API call, or one batch line's body.

    ``param`` names the field at fault (OpenAI's ``error.param``), ``code`` is OpenAI's ``error.code``.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class Conflict(ValueError):
    """A request the current state of another object forbids (a 409), e.g. deleting a file a schedule
    uses; ``code`` is OpenAI's ``error.code``."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def error_envelope(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope: ``{"error": {message, type, param, code}}`` (HTTP errors and batch-line bodies)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
