"""FastAPI dependencies: the app's settings and one database session per request."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from jobs.config import Settings
from jobs.db import session_scope


def get_app_settings(request: Request) -> Settings:
    """The `Settings` the app was created with (`api.main.create_app`)."""
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def session_dependency(*, read_only: bool) -> Callable[[Settings], Iterator[Session]]:
    """A dependency yielding one `jobs.db.session_scope` transaction per request.

    ``read_only=False``: the transaction commits when the endpoint returns (rolls back if it raises); a
    failed commit raises `sqlalchemy.exc.SQLAlchemyError`, so the app answers 500, never the endpoint's
    200. ``read_only=True``: for endpoints that only read; on SQLite it takes no write lock, so a GET
    neither waits for nor stalls a worker's write (docs/api.md, "Concurrency").
    """

    def session(settings: SettingsDep) -> Iterator[Session]:
        with session_scope(settings.database_url, read_only=read_only) as scoped:
            yield scoped

    return session


get_session = session_dependency(read_only=False)
get_read_session = session_dependency(read_only=True)
# NOTE: scope="function" commits before the response is sent. FastAPI's default ("request") commits
# after, so a client could receive an id and ask for it before the row was visible (and a failed
# commit could follow a 200). Background tasks run after the response, so they see the commit too.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
"""A write session: for every endpoint that writes, even one row."""
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]
"""A read-only session: for endpoints that only read (every GET but ``/health`` and ``/metrics``,
which take a read-only connection of their own)."""
