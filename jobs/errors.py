"""Domain errors the API turns into OpenAI-style error responses (see `api/errors.py`)."""

from __future__ import annotations


class NotFound(LookupError):
    """No such object (a 404): ``kind`` is "file" or "batch", ``object_id`` the id asked for."""

    def __init__(self, kind: str, object_id: str) -> None:
        super().__init__(f"no {kind} with id {object_id!r}")
        self.kind = kind
        self.object_id = object_id


class InvalidRequest(ValueError):
    """A request the service refuses (a 400); ``param`` names the field at fault, ``code`` is OpenAI's."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
