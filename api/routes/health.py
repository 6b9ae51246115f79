"""``GET /health``: the database and the broker, each ``"ok"`` or the reason it is not.

- both answer: 200 ``{"status": "ok", ...}``;
- the broker does not: 200 ``{"status": "degraded", ...}``: batches are still accepted and validated,
  and the reaper sends their work once the broker is back (docs/operations.md);
- the database does not: 503 ``{"status": "unavailable", ...}``.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError as BrokerUnreachable
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from api.deps import SettingsDep
from jobs.db import get_engine
from jobs.queue import ping_broker

router = APIRouter(tags=["health"])
_BROKER_TIMEOUT_S = 2.0


@router.get("/health")
def health(settings: SettingsDep) -> JSONResponse:
    database = broker = "ok"
    try:
        with get_engine(settings.database_url, read_only=True).connect() as connection:
            connection.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        database = str(getattr(exc, "orig", None) or exc)
    try:
        ping_broker(broker_url=settings.broker_url, timeout_s=_BROKER_TIMEOUT_S)
    except (BrokerUnreachable, OSError) as exc:
        broker = str(exc) or type(exc).__name__
    content = {"database": database, "broker": broker, "model": settings.served_model_name}
    if database != "ok":
        return JSONResponse(status_code=503, content={"status": "unavailable", **content})
    return JSONResponse(content={"status": "ok" if broker == "ok" else "degraded", **content})
