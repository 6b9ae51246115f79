"""Who is asking: the API key behind a request, and so whose files, batches and schedules it may see.

``Authorization: Bearer <key>`` (what the ``openai`` SDK sends), or HTTP Basic with the key as the
password (what a browser prompts for on ``/ui``). While the deployment has no key at all the API is
open and every request is the anonymous owner ``None`` (`jobs.api_keys.keys_required`); once a key
exists, a request without a live key is a 401 ``invalid_api_key``. Design: docs/api.md, "API keys".
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.deps import SettingsDep
from jobs.api_keys import find_key, keys_required
from jobs.db import session_scope


class Unauthorized(Exception):
    """No live API key in a request to a deployment that has keys (a 401); ``browser``: a ``/ui`` page."""

    def __init__(self, message: str, *, browser: bool) -> None:
        super().__init__(message)
        self.message = message
        self.browser = browser


def _presented_secret(authorization: str) -> str | None:
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        try:
            _user, _, password = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return password or None
    return None


def owner_of(session: Session, *, authorization: str, browser: bool) -> str | None:
    """The id of the API key in an ``Authorization`` header value, or None while the deployment has no key.

    ``browser``: the request is for a ``/ui`` page (its 401 asks for HTTP Basic credentials).

    Raises:
        Unauthorized: the deployment has keys and the header carries none, or a wrong or revoked one.
    """
    secret = _presented_secret(authorization)
    if secret is not None:
        key = find_key(session, secret=secret)
        if key is not None:
            return key.id
        if keys_required(session):
            raise Unauthorized("Incorrect API key provided (unknown or revoked).", browser=browser)
        return None
    if keys_required(session):
        raise Unauthorized(
            "You didn't provide an API key: send it as 'Authorization: Bearer <key>' (create one with "
            "'batchinfer keys create').",
            browser=browser,
        )
    return None


def is_browser_path(path: str) -> bool:
    """Whether ``path`` is a ``/ui`` page, whose 401 asks a browser for credentials."""
    return path == "/ui" or path.startswith("/ui/")


def get_owner(request: Request, settings: SettingsDep) -> str | None:
    """`owner_of` the request's ``Authorization`` header, read in a read-only transaction of its own
    (ended before the endpoint's session takes a connection), so a GET takes no write lock.

    Raises:
        Unauthorized: the deployment has keys and the request carries none, or a wrong or revoked one.
    """
    with session_scope(settings.database_url, read_only=True) as session:
        return owner_of(
            session, authorization=request.headers.get("authorization", ""), browser=is_browser_path(request.url.path)
        )


OwnerDep = Annotated[str | None, Depends(get_owner)]
