"""FastAPI dependencies: the app's settings and one database session per request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from jobs.config import Settings
from jobs.db import session_scope


def get_app_settings(request: Request) -> Settings:
    """The `Settings` the app was created with (`api.main.create_app`)."""
    settings: Settings = request.app.state.settings
    return settings


def get_session(settings: Annotated[Settings, Depends(get_app_settings)]) -> Iterator[Session]:
    """A session whose transaction commits when the endpoint returns (rolls back if it raises).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the commit failed (the app answers 500, never the endpoint's 200).
    """
    with session_scope(settings.database_url) as session:
        yield session


def get_read_session(settings: Annotated[Settings, Depends(get_app_settings)]) -> Iterator[Session]:
    """A read-only session (`jobs.db.session_scope` with ``read_only``) for endpoints that only read:
    on SQLite it takes no write lock, so a GET neither waits for nor stalls a worker's write."""
    with session_scope(settings.database_url, read_only=True) as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
# NOTE: scope="function" commits before the response is sent. FastAPI's default ("request") commits
# after, so a client could receive an id and ask for it before the row was visible (and a failed
# commit could follow a 200). Background tasks run after the response, so they see the commit too.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]
