"""``/v1/evals``: OpenAI's Evals API over our queue and engine (docs/api.md, "Evals").

Evals: create, list, retrieve, update, delete. Runs (``/v1/evals/{eval_id}/runs``): create, list,
retrieve, cancel, delete; a run's generation is a batch of its items (`jobs.evals.repository.create_run`),
started after the response as ``POST /v1/batches`` starts one (`jobs.evals.dispatch.start_run`), and
graded per shard by the workers. Output items (``.../runs/{run_id}/output_items``): list, retrieve.
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from fastapi import APIRouter, BackgroundTasks, Query, Request
from sqlalchemy.orm import Session

from api.auth import OwnerDep
from api.deps import ReadSessionDep, SessionDep, SettingsDep
from jobs.config import Settings
from jobs.evals.dispatch import start_run
from jobs.evals.repository import (
    cancel_run,
    create_eval,
    create_run,
    delete_eval,
    delete_run,
    get_eval,
    get_output_item,
    get_run,
    list_evals,
    list_output_items,
    list_runs,
    run_batch,
    update_eval,
)
from jobs.evals.schemas import (
    EvalCreateRequest,
    EvalDeleted,
    EvalObject,
    EvalUpdateRequest,
    OutputItemObject,
    RunCreateRequest,
    RunDeleted,
    RunObject,
)
from jobs.models import EvalRun
from jobs.schemas import ListPage
from jobs.storage import storage_from_settings

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/evals", tags=["evals"])
Limit = Annotated[int, Query(ge=1, le=100)]
Order = Literal["asc", "desc"]


def _run_object(session: Session, run: EvalRun, request: Request) -> RunObject:
    return RunObject.from_row(run, batch=run_batch(session, run), base_url=str(request.base_url))


def _start_in_background(run_id: str, settings: Settings) -> None:
    try:
        start_run(run_id, settings=settings)
    except Exception:
        logger.exception("starting eval run %s failed", run_id)


@router.post("", response_model=EvalObject)
def create(request: EvalCreateRequest, session: SessionDep, owner: OwnerDep, settings: SettingsDep) -> EvalObject:
    """Create an eval; a refused item schema, grader or template is a 400 naming the field."""
    row = create_eval(
        session,
        model_aliases=settings.generate_model_aliases,
        has_embedding_model=any(entry.kind == "embed" for entry in settings.models),
        item_schema=request.data_source_config.item_schema,
        include_sample_schema=request.data_source_config.include_sample_schema,
        testing_criteria=request.testing_criteria,
        name=request.name,
        metadata=request.metadata,
        owner=owner,
    )
    return EvalObject.from_row(row)


@router.get("", response_model=ListPage[EvalObject])
def list_all(
    session: ReadSessionDep, owner: OwnerDep, after: str | None = None, limit: Limit = 20, order: Order = "asc"
) -> ListPage[EvalObject]:
    rows, has_more = list_evals(session, after=after, limit=limit, order=order, owner=owner)
    return ListPage[EvalObject].of([EvalObject.from_row(row) for row in rows], has_more)


@router.get("/{eval_id}", response_model=EvalObject)
def retrieve(session: ReadSessionDep, owner: OwnerDep, eval_id: str) -> EvalObject:
    return EvalObject.from_row(get_eval(session, eval_id=eval_id, owner=owner))


@router.post("/{eval_id}", response_model=EvalObject)
def update(request: EvalUpdateRequest, session: SessionDep, owner: OwnerDep, eval_id: str) -> EvalObject:
    row = update_eval(session, eval_id=eval_id, name=request.name, metadata=request.metadata, owner=owner)
    return EvalObject.from_row(row)


@router.delete("/{eval_id}", response_model=EvalDeleted)
def remove(session: SessionDep, owner: OwnerDep, eval_id: str) -> EvalDeleted:
    delete_eval(session, eval_id=eval_id, owner=owner)
    return EvalDeleted(eval_id=eval_id)


@router.post("/{eval_id}/runs", response_model=RunObject)
def create_a_run(
    body: RunCreateRequest,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    owner: OwnerDep,
    eval_id: str,
    background_tasks: BackgroundTasks,
) -> RunObject:
    """Create a ``queued`` run; its batch is validated and started after the response."""
    run = create_run(
        session,
        eval_id=eval_id,
        data_source=body.data_source,
        served_model=settings.served_model_name,
        aliases=settings.generate_model_aliases,
        storage=storage_from_settings(settings),
        max_items=settings.max_file_lines,
        name=body.name,
        metadata=body.metadata,
        owner=owner,
    )
    background_tasks.add_task(_start_in_background, run.id, settings)
    return _run_object(session, run, request)


@router.get("/{eval_id}/runs", response_model=ListPage[RunObject])
def list_all_runs(
    request: Request,
    session: ReadSessionDep,
    owner: OwnerDep,
    eval_id: str,
    after: str | None = None,
    limit: Limit = 20,
    order: Order = "asc",
    status: Literal["queued", "in_progress", "completed", "canceled", "failed"] | None = None,
) -> ListPage[RunObject]:
    runs, has_more = list_runs(
        session, eval_id=eval_id, after=after, limit=limit, order=order, status=status, owner=owner
    )
    return ListPage[RunObject].of([_run_object(session, run, request) for run in runs], has_more)


@router.get("/{eval_id}/runs/{run_id}", response_model=RunObject)
def retrieve_run(request: Request, session: ReadSessionDep, owner: OwnerDep, eval_id: str, run_id: str) -> RunObject:
    return _run_object(session, get_run(session, eval_id=eval_id, run_id=run_id, owner=owner), request)


@router.post("/{eval_id}/runs/{run_id}/cancel", response_model=RunObject)
def cancel(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    owner: OwnerDep,
    eval_id: str,
    run_id: str,
) -> RunObject:
    """Cancel the run and its batch: ``canceled`` at once, with final counts (items not yet graded are errors)."""
    storage = storage_from_settings(settings)
    run = cancel_run(session, eval_id=eval_id, run_id=run_id, owner=owner, storage=storage)
    return _run_object(session, run, request)


@router.delete("/{eval_id}/runs/{run_id}", response_model=RunDeleted)
def remove_run(session: SessionDep, owner: OwnerDep, eval_id: str, run_id: str) -> RunDeleted:
    delete_run(session, eval_id=eval_id, run_id=run_id, owner=owner)
    return RunDeleted(run_id=run_id)


@router.get("/{eval_id}/runs/{run_id}/output_items", response_model=ListPage[OutputItemObject])
def list_items(
    session: ReadSessionDep,
    owner: OwnerDep,
    eval_id: str,
    run_id: str,
    after: str | None = None,
    limit: Limit = 20,
    order: Order = "asc",
    status: Literal["pass", "fail", "error", "pending"] | None = None,
) -> ListPage[OutputItemObject]:
    items, has_more = list_output_items(
        session, eval_id=eval_id, run_id=run_id, after=after, limit=limit, order=order, status=status, owner=owner
    )
    return ListPage[OutputItemObject].of([OutputItemObject.from_row(item) for item in items], has_more)


@router.get("/{eval_id}/runs/{run_id}/output_items/{output_item_id}", response_model=OutputItemObject)
def retrieve_item(
    session: ReadSessionDep, owner: OwnerDep, eval_id: str, run_id: str, output_item_id: str
) -> OutputItemObject:
    item = get_output_item(session, eval_id=eval_id, run_id=run_id, output_item_id=output_item_id, owner=owner)
    return OutputItemObject.from_row(item)
