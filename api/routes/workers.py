"""``GET /v1/workers`` (batchinfer's own): the live workers, from the heartbeats they write.

A worker is live while its last heartbeat is at most ``Settings.worker_live_s`` seconds old
(docs/api.md, "Workers"; the heartbeat is `worker.telemetry.Heartbeat`).
"""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import SessionDep, SettingsDep
from jobs.status import now_s
from jobs.workers import WorkerList, WorkerObject, list_live_workers

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("", response_model=WorkerList)
def list_all(session: SessionDep, settings: SettingsDep) -> WorkerList:
    """Every live worker, most recently started first (not paged: a deployment has few)."""
    rows = list_live_workers(session, now=now_s(), live_s=settings.worker_live_s)
    return WorkerList(data=[WorkerObject.from_row(row) for row in rows])
