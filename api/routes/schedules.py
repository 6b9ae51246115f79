"""``/v1/schedules``: scheduled evaluation runs (batchinfer's own): create, retrieve, list, delete.

A schedule creates a batch of ``input_file_id`` at every tick of ``cron`` (5 fields, UTC), exactly
as ``POST /v1/batches`` would, with ``schedule_id`` added to the batch metadata; or, given ``eval_id``
and ``run`` (the ``POST /v1/evals/{eval_id}/runs`` body), a run of that eval, ``schedule_id`` added to
the run's metadata. Celery beat drives the ticks (see `jobs.schedules`). Deleting a schedule keeps the
batches and runs it created.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict

from api.auth import OwnerDep
from api.deps import ReadSessionDep, SessionDep
from jobs.schedules import (
    ScheduleDeleted,
    ScheduleObject,
    create_schedule,
    delete_schedule,
    get_schedule,
    list_schedules,
)
from jobs.schemas import COMPLETION_WINDOW, ListPage

router = APIRouter(prefix="/v1/schedules", tags=["schedules"])


class ScheduleCreateRequest(BaseModel):
    """``POST /v1/schedules`` body; an unknown field is rejected with its name."""

    model_config = ConfigDict(extra="forbid")

    cron: str
    input_file_id: str | None = None
    endpoint: str | None = None
    eval_id: str | None = None
    run: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    completion_window: str = COMPLETION_WINDOW


@router.post("", response_model=ScheduleObject)
def create(request: ScheduleCreateRequest, session: SessionDep, owner: OwnerDep) -> ScheduleObject:
    schedule = create_schedule(
        session,
        cron=request.cron,
        input_file_id=request.input_file_id,
        endpoint=request.endpoint,
        eval_id=request.eval_id,
        run=request.run,
        metadata=request.metadata,
        completion_window=request.completion_window,
        owner=owner,
    )
    return ScheduleObject.from_row(schedule)


@router.get("", response_model=ListPage[ScheduleObject])
def list_all(
    session: ReadSessionDep, owner: OwnerDep, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
) -> ListPage[ScheduleObject]:
    """Schedules, newest first; ``after`` is the last id of the previous page."""
    schedules, has_more = list_schedules(session, after=after, limit=limit, owner=owner)
    data = [ScheduleObject.from_row(schedule) for schedule in schedules]
    return ListPage[ScheduleObject].of(data, has_more)


@router.get("/{schedule_id}", response_model=ScheduleObject)
def retrieve(session: ReadSessionDep, owner: OwnerDep, schedule_id: str) -> ScheduleObject:
    return ScheduleObject.from_row(get_schedule(session, schedule_id=schedule_id, owner=owner))


@router.delete("/{schedule_id}", response_model=ScheduleDeleted)
def remove(session: SessionDep, owner: OwnerDep, schedule_id: str) -> ScheduleDeleted:
    delete_schedule(session, schedule_id=schedule_id, owner=owner)
    return ScheduleDeleted(id=schedule_id)
