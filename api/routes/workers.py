"""``GET /v1/workers`` (batchinfer's own): the live workers, from the heartbeats they write.

A worker is live while its last heartbeat is at most ``Settings.worker_live_s`` seconds old
(docs/api.md, "Workers"; the heartbeat is `worker.telemetry.Heartbeat`). Every key sees every worker;
``current_batch_id`` only when the request's key owns that batch (`jobs.workers.live_worker_objects`).
"""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import OwnerDep
from api.deps import ReadSessionDep, SettingsDep
from jobs.status import now_s
from jobs.workers import WorkerList, live_worker_objects

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("", response_model=WorkerList)
def list_all(session: ReadSessionDep, settings: SettingsDep, owner: OwnerDep) -> WorkerList:
    """Every live worker, most recently started first (not paged: a deployment has few)."""
    return WorkerList(data=live_worker_objects(session, now=now_s(), live_s=settings.worker_live_s, owner=owner))
