"""``GET /health``: 200 ``{"status": "ok"}`` when the database answers, else 503 with the reason."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from api.deps import SettingsDep
from jobs.db import get_engine

router = APIRouter(tags=["health"])


@router.get("/health")
def health(settings: SettingsDep) -> JSONResponse:
    try:
        with get_engine(settings.database_url).connect() as connection:
            connection.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        return JSONResponse(
            status_code=503, content={"status": "unavailable", "database": str(getattr(exc, "orig", None) or exc)}
        )
    return JSONResponse(content={"status": "ok", "database": "ok", "model": settings.served_model_name})
