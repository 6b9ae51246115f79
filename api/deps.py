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
    return request.app.state.settings


def get_session(settings: Annotated[Settings, Depends(get_app_settings)]) -> Iterator[Session]:
    """A session whose transaction commits after the endpoint returns (rolls back if it raises)."""
    with session_scope(settings.database_url) as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
