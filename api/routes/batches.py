"""``/v1/batches``: create, retrieve, list (cursor paging), cancel (OpenAI Batch API).

Validation runs right after creation as a FastAPI background task (`jobs.intake.validate_and_start`):
the create call returns the batch in status ``validating``; a client polls until it moves on to
``in_progress`` or ``failed``. Cancel: ``validating | in_progress -> cancelling``; a batch no worker
has claimed yet is finalized to ``cancelled`` in the same call (see `jobs.repository.cancel_batch`).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Query
from pydantic import BaseModel, ConfigDict

from api.auth import OwnerDep
from api.deps import ReadSessionDep, SessionDep, SettingsDep
from api.quotas import check_enqueued_tokens
from jobs.config import Settings
from jobs.intake import validate_and_start
from jobs.repository import cancel_batch, create_batch, get_batch, get_batch_input_file, list_batches
from jobs.schemas import COMPLETION_WINDOW, BatchObject, ListPage
from jobs.storage import storage_from_settings

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/batches", tags=["batches"])


class BatchCreateRequest(BaseModel):
    """``POST /v1/batches`` body; fields OpenAI added that this service does not use are ignored."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str = COMPLETION_WINDOW
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


def validate_in_background(batch_id: str, settings: Settings) -> None:
    """Background-task wrapper of `validate_and_start`: a failure is logged, never raised into the server."""
    try:
        validate_and_start(batch_id, settings=settings)
    except Exception:
        logger.exception("validating batch %s failed", batch_id)


@router.post("", response_model=BatchObject)
def create(
    request: BatchCreateRequest,
    session: SessionDep,
    settings: SettingsDep,
    owner: OwnerDep,
    background_tasks: BackgroundTasks,
) -> BatchObject:
    """Create a ``validating`` batch of an uploaded file; over the key's enqueued-token limit it is a 429
    ``token_limit_exceeded`` (`api.quotas`)."""
    if settings.max_enqueued_tokens:
        input_file = get_batch_input_file(session, file_id=request.input_file_id, owner=owner)
        check_enqueued_tokens(
            session,
            owner=owner,
            input_file_bytes=input_file.num_bytes,
            max_enqueued_tokens=settings.max_enqueued_tokens,
        )
    batch = create_batch(
        session,
        input_file_id=request.input_file_id,
        endpoint=request.endpoint,
        completion_window=request.completion_window,
        metadata=request.metadata,
        owner=owner,
    )
    background_tasks.add_task(validate_in_background, batch.id, settings)
    return BatchObject.from_row(batch)


@router.get("", response_model=ListPage[BatchObject])
def list_all(
    session: ReadSessionDep, owner: OwnerDep, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
) -> ListPage[BatchObject]:
    """Batches, newest first; ``after`` is the last id of the previous page."""
    batches, has_more = list_batches(session, after=after, limit=limit, owner=owner)
    data = [BatchObject.from_row(batch) for batch in batches]
    return ListPage[BatchObject].of(data, has_more)


@router.get("/{batch_id}", response_model=BatchObject)
def retrieve(session: ReadSessionDep, owner: OwnerDep, batch_id: str) -> BatchObject:
    return BatchObject.from_row(get_batch(session, batch_id=batch_id, owner=owner))


@router.post("/{batch_id}/cancel", response_model=BatchObject)
def cancel(session: SessionDep, settings: SettingsDep, owner: OwnerDep, batch_id: str) -> BatchObject:
    storage = storage_from_settings(settings)
    return BatchObject.from_row(cancel_batch(session, batch_id=batch_id, storage=storage, owner=owner))
