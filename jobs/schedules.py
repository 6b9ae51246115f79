"""Scheduled evaluation runs: at every tick of its cron a schedule creates a batch of its input file, or
a run of its eval (``eval_id`` and ``run_spec``, the ``POST /v1/evals/{eval_id}/runs`` body).

Data functions (keyword-only; the caller owns the transaction) plus `run_due_schedules`, the tick
that Celery beat drives (`jobs.tasks.tick_schedules`, every `jobs.queue.SCHEDULE_TICK_S` seconds):

1. list the schedules whose ``next_run_at <= now``;
2. for each, in its own transaction: lock the row (``SELECT ... FOR UPDATE SKIP LOCKED`` on
   PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` serializes writers), re-check that it is still due,
   create the batch with `jobs.repository.create_batch` (the ``POST /v1/batches`` path; metadata gets
   ``schedule_id``) or the eval run with `jobs.evals.repository.create_run` (the runs-create path; the
   run's metadata gets ``schedule_id``), and advance ``next_run_at`` to the first cron time after ``now``;
3. after that commit, validate and enqueue the batch with `jobs.intake.validate_and_start`, as the
   API does after ``POST /v1/batches`` (an eval run: `jobs.evals.dispatch.start_run`).

Concurrent ticks therefore never fire one schedule twice for one due time: the second either skips
the locked row or, once the first committed, finds it no longer due. Missed ticks (beat or the
worker down, or busy with a long batch) are coalesced: one batch, then the next time after ``now``.
Cron expressions have 5 fields (minute hour day-of-month month day-of-week), parsed by ``croniter``
and evaluated in UTC.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from croniter import CroniterError, croniter
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.config import Settings, get_settings
from jobs.db import session_scope
from jobs.errors import InvalidRequest, NotFound
from jobs.evals.data_sources import parse_data_source
from jobs.evals.dispatch import start_run
from jobs.evals.repository import create_run, get_eval
from jobs.evals.schemas import RunCreateRequest
from jobs.intake import validate_and_start, validate_input_file
from jobs.models import SCHEDULE_ID_PREFIX, File, Schedule, new_id
from jobs.paging import keyset_page
from jobs.repository import check_batch_params, create_batch, get_batch_input_file
from jobs.schemas import COMPLETION_WINDOW, ListedObject
from jobs.status import now_s
from jobs.storable_text import is_possible_id
from jobs.storage import storage_from_settings

logger = logging.getLogger(__name__)

CRON_NUM_FIELDS = 5
SCHEDULE_ID_METADATA_KEY = "schedule_id"


class ScheduleObject(ListedObject):
    """A schedule as the API returns it; ``*_at`` fields are Unix seconds."""

    object: Literal["schedule"] = "schedule"
    cron: str
    input_file_id: str | None
    endpoint: str | None
    eval_id: str | None
    run: dict[str, Any] | None
    completion_window: str
    metadata: dict[str, str] | None
    created_at: int
    next_run_at: int
    last_run_at: int | None
    last_batch_id: str | None
    last_run_id: str | None

    @classmethod
    def from_row(cls, schedule: Schedule) -> ScheduleObject:
        return cls(
            id=schedule.id,
            cron=schedule.cron,
            input_file_id=schedule.input_file_id,
            endpoint=schedule.endpoint,
            eval_id=schedule.eval_id,
            run=schedule.run_spec,
            completion_window=schedule.completion_window,
            metadata=schedule.metadata_,
            created_at=schedule.created_at,
            next_run_at=schedule.next_run_at,
            last_run_at=schedule.last_run_at,
            last_batch_id=schedule.last_batch_id,
            last_run_id=schedule.last_run_id,
        )


class ScheduleDeleted(BaseModel):
    id: str
    object: Literal["schedule.deleted"] = "schedule.deleted"
    deleted: bool = True


@dataclass(slots=True)
class ScheduledRun:
    """One schedule fired by a tick: the batch (and eval run) it created, or why none was (``error``)."""

    schedule_id: str
    batch_id: str | None
    error: str | None = None
    run_id: str | None = None


def next_run_after(cron: str, after_s: int) -> int:
    """The first time (Unix seconds) matching ``cron`` strictly after ``after_s``, in UTC.

    Raises:
        InvalidRequest: ``cron`` is not a valid 5-field expression, or never matches (``param="cron"``).
    """
    fields = cron.split()
    if len(fields) != CRON_NUM_FIELDS or not croniter.is_valid(cron):
        raise InvalidRequest(
            f"cron {cron!r} is not a valid 5-field cron expression (minute hour day-of-month month day-of-week)",
            param="cron",
        )
    try:
        return int(croniter(cron, datetime.fromtimestamp(after_s, UTC)).get_next(float))
    except CroniterError:
        raise InvalidRequest(f"cron {cron!r} never matches a date", param="cron") from None


def batch_metadata(schedule: Schedule) -> dict[str, str]:
    """The metadata of a batch the schedule creates: the schedule's, plus ``schedule_id``."""
    return {**(schedule.metadata_ or {}), SCHEDULE_ID_METADATA_KEY: schedule.id}


def create_schedule(
    session: Session,
    *,
    cron: str,
    input_file_id: str | None = None,
    endpoint: str | None = None,
    eval_id: str | None = None,
    run: dict[str, Any] | None = None,
    metadata: dict[str, str] | None = None,
    completion_window: str = COMPLETION_WINDOW,
    owner: str | None = None,
    now: int | None = None,
    settings: Settings | None = None,
) -> Schedule:
    """Insert a schedule whose first run is the first ``cron`` time after ``now`` (flushed, not committed).

    ``owner``: the API key that owns it, its input file and the batches it creates (None: no key).
    A schedule runs either ``input_file_id`` as ``endpoint``, or eval ``eval_id`` from ``run`` (the
    ``POST /v1/evals/{eval_id}/runs`` body, its ``data_source`` checked now as that route would).

    Checks now what each run's ``POST /v1/batches`` and its validation would check (the file cannot be
    deleted while the schedule exists: ``DELETE /v1/files`` asks `schedules_using_file`): endpoint,
    completion window, metadata with room for ``schedule_id`` (and without a ``schedule_id`` key of its
    own, which every batch's would overwrite), an input file of purpose "batch", and that file's
    structure for ``endpoint`` (`jobs.validation`: every line's ``url`` is the endpoint, its model the
    served one, ...; one pass over the file).

    Raises:
        InvalidRequest: a bad ``cron`` (``param="cron"``), an unknown input file or one not of
            purpose "batch" (``param="input_file_id"``), a file every run would fail on
            (``param="input_file_id"``, the code and message of its first problem, with its line
            number), a ``schedule_id`` metadata key (``param="metadata"``), or what `check_batch_params`
            rejects; for an eval, an unknown eval (``param="eval_id"``), a refused ``run`` (``param``
            names its field), or both or neither of ``input_file_id`` and ``eval_id``.
    """
    now = now_s() if now is None else now
    settings = settings or get_settings()
    cron = " ".join(cron.split())
    next_run_at = next_run_after(cron, now)
    schedule_id = new_id(SCHEDULE_ID_PREFIX)
    if metadata and SCHEDULE_ID_METADATA_KEY in metadata:
        raise InvalidRequest(
            f"metadata key {SCHEDULE_ID_METADATA_KEY!r} is reserved: each batch of the schedule gets the "
            "schedule's id there",
            param="metadata",
        )
    if (eval_id is None) == (input_file_id is None):
        raise InvalidRequest("a schedule runs either an input_file_id or an eval_id (with run)", param="eval_id")
    run_spec = None
    if eval_id is not None:
        run_spec = _check_run(
            session, eval_id=eval_id, run=run, schedule_id=schedule_id, owner=owner, settings=settings
        )
    else:
        if endpoint is None:
            raise InvalidRequest("a schedule of an input file needs its endpoint", param="endpoint")
        check_batch_params(
            endpoint=endpoint,
            completion_window=completion_window,
            metadata={**(metadata or {}), SCHEDULE_ID_METADATA_KEY: schedule_id},
        )
        assert input_file_id is not None
        file = get_batch_input_file(session, file_id=input_file_id, owner=owner)
        _check_input_file(session, file, endpoint, settings)
    schedule = Schedule(
        owner_key_id=owner,
        id=schedule_id,
        cron=cron,
        input_file_id=input_file_id,
        endpoint=endpoint,
        eval_id=eval_id,
        run_spec=run_spec,
        completion_window=completion_window,
        metadata_=metadata,
        created_at=now,
        next_run_at=next_run_at,
    )
    session.add(schedule)
    session.flush()
    return schedule


def _check_run(
    session: Session,
    *,
    eval_id: str,
    run: dict[str, Any] | None,
    schedule_id: str,
    owner: str | None,
    settings: Settings,
) -> dict[str, Any]:
    """The run spec (``{data_source, name?, metadata?}``) as stored, checked as ``POST .../runs`` would
    check its body (the rows themselves are read at each tick)."""
    try:
        row = get_eval(session, eval_id=eval_id, owner=owner)
    except NotFound:
        raise InvalidRequest(f"no eval {eval_id!r}", param="eval_id") from None
    if not isinstance(run, dict):
        raise InvalidRequest("a schedule of an eval needs run: the POST /v1/evals/{eval_id}/runs body", param="run")
    try:
        spec = RunCreateRequest.model_validate(run)
    except ValueError:
        raise InvalidRequest("run must be {data_source, name?, metadata?}", param="run") from None
    if spec.metadata and SCHEDULE_ID_METADATA_KEY in spec.metadata:
        raise InvalidRequest(
            f"run metadata key {SCHEDULE_ID_METADATA_KEY!r} is reserved: each run gets the schedule's id there",
            param="run.metadata",
        )
    item_schema = row.data_source_config["item_schema"]
    try:
        parse_data_source(
            spec.data_source,
            item_schema=item_schema,
            served_model=settings.served_model_name,
            aliases=settings.generate_model_aliases,
        )
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param=f"run.{exc.param}" if exc.param else "run", code=exc.code) from None
    return spec.model_dump(exclude_none=True)


def _check_input_file(session: Session, file: File, endpoint: str, settings: Settings) -> None:
    """Refuse a file whose structure every run of ``endpoint`` would fail on (module docstring of
    `jobs.validation`), naming the first problem and its line."""
    storage = storage_from_settings(settings)
    result = validate_input_file(file, endpoint=endpoint, settings=settings, storage=storage, session=session)
    if result.ok:
        return
    first = result.errors[0]
    where = "" if first.line is None else f"line {first.line}: "
    more = f" (and {result.num_errors - 1} more)" if result.num_errors > 1 else ""
    raise InvalidRequest(
        f"every run of file {file.id!r} as {endpoint} would fail: {where}{first.message}{more}",
        param="input_file_id",
        code=first.code,
    )


def get_schedule(session: Session, *, schedule_id: str, owner: str | None = None) -> Schedule:
    """The schedule, re-read from the database.

    Raises:
        NotFound: no schedule has this id (owned by API key ``owner``, when given).
    """
    if not is_possible_id(schedule_id):
        raise NotFound("schedule", schedule_id)
    query = select(Schedule).where(Schedule.id == schedule_id).execution_options(populate_existing=True)
    if owner is not None:
        query = query.where(Schedule.owner_key_id == owner)
    schedule = session.scalar(query)
    if schedule is None:
        raise NotFound("schedule", schedule_id)
    return schedule


def list_schedules(
    session: Session, *, after: str | None = None, limit: int = 20, owner: str | None = None
) -> tuple[list[Schedule], bool]:
    """A page of schedules (of API key ``owner``, when given), newest first, after the schedule
    ``after``; returns ``(schedules, has_more)``.

    Raises:
        jobs.paging.UnknownCursor: ``after`` is not a schedule id (of ``owner``).
    """
    query = select(Schedule) if owner is None else select(Schedule).where(Schedule.owner_key_id == owner)
    return keyset_page(session, query, Schedule, after=after, limit=limit, owner=owner)


def delete_schedule(session: Session, *, schedule_id: str, owner: str | None = None) -> None:
    """Delete the schedule (batches it already created are kept).

    Raises:
        NotFound: no schedule has this id (owned by API key ``owner``, when given).
    """
    session.delete(get_schedule(session, schedule_id=schedule_id, owner=owner))
    session.flush()


def schedules_using_file(session: Session, *, file_id: str) -> list[str]:
    """Ids of the schedules whose input file is ``file_id``, oldest first (deleting the file would
    leave each of them creating no batch at all)."""
    query = select(Schedule.id).where(Schedule.input_file_id == file_id).order_by(Schedule.created_at, Schedule.id)
    return list(session.scalars(query))


def due_schedule_ids(session: Session, *, now: int) -> list[str]:
    """Ids of the schedules with ``next_run_at <= now``, most overdue first (no lock taken)."""
    query = select(Schedule.id).where(Schedule.next_run_at <= now).order_by(Schedule.next_run_at, Schedule.id)
    return list(session.scalars(query))


def fire_schedule(
    session: Session, *, schedule_id: str, now: int, settings: Settings | None = None
) -> ScheduledRun | None:
    """Create the schedule's batch (or eval run) for this tick and advance ``next_run_at`` past ``now``.

    Locks the schedule row (PostgreSQL: ``FOR UPDATE SKIP LOCKED``), so call it in a short
    transaction of its own and commit before validating the batch. A batch the file checks refuse
    (input file gone: deleted before ``DELETE /v1/files`` checked `schedules_using_file`) is not
    created; the schedule still advances and ``error`` says why (so too for an eval run its eval, gone,
    or its data source, no longer readable, refuses).

    Returns:
        the run, or None when the schedule is gone, no longer due, or being fired by another tick.
    """
    query = (
        select(Schedule)
        .where(Schedule.id == schedule_id, Schedule.next_run_at <= now)
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    )
    schedule = session.scalar(query)
    if schedule is None:
        return None
    if schedule.eval_id is not None:
        run = _fire_eval(session, schedule, now, settings or get_settings())
    else:
        run = _fire_batch(session, schedule, now)
    schedule.next_run_at = next_run_after(schedule.cron, now)
    session.flush()
    return run


def _fire_eval(session: Session, schedule: Schedule, now: int, settings: Settings) -> ScheduledRun:
    assert schedule.eval_id is not None and schedule.run_spec is not None
    spec = schedule.run_spec
    try:
        eval_run = create_run(
            session,
            eval_id=schedule.eval_id,
            data_source=spec["data_source"],
            served_model=settings.served_model_name,
            aliases=settings.generate_model_aliases,
            storage=storage_from_settings(settings),
            max_items=settings.max_file_lines,
            name=spec.get("name"),
            metadata={**(spec.get("metadata") or {}), SCHEDULE_ID_METADATA_KEY: schedule.id},
            owner=schedule.owner_key_id,
            now=now,
        )
    except (InvalidRequest, NotFound) as exc:
        return ScheduledRun(schedule_id=schedule.id, batch_id=None, error=str(exc))
    schedule.last_run_at = now
    schedule.last_run_id = eval_run.id
    schedule.last_batch_id = eval_run.batch_id
    return ScheduledRun(schedule_id=schedule.id, batch_id=eval_run.batch_id, run_id=eval_run.id)


def _fire_batch(session: Session, schedule: Schedule, now: int) -> ScheduledRun:
    assert schedule.input_file_id is not None and schedule.endpoint is not None
    try:
        batch = create_batch(
            session,
            input_file_id=schedule.input_file_id,
            endpoint=schedule.endpoint,
            completion_window=schedule.completion_window,
            metadata=batch_metadata(schedule),
            owner=schedule.owner_key_id,
            now=now,
        )
    except InvalidRequest as exc:
        return ScheduledRun(schedule_id=schedule.id, batch_id=None, error=exc.message)
    schedule.last_run_at = now
    schedule.last_batch_id = batch.id
    return ScheduledRun(schedule_id=schedule.id, batch_id=batch.id)


def run_due_schedules(*, settings: Settings | None = None, now: int | None = None) -> list[ScheduledRun]:
    """The beat tick: fire every due schedule once, then validate and enqueue the batches (start the eval
    runs) created.

    Safe to run concurrently (see the module docstring). A batch whose validation raises (e.g. the
    database is unreachable) is logged and stays as `validate_and_start` left it, as after
    ``POST /v1/batches``; an unreachable broker does not raise (the reaper sends the messages later).

    Args:
        now: the tick time in Unix seconds (default: the current time); batches get ``created_at = now``.

    Returns:
        the runs this tick fired, most overdue first.
    """
    settings = settings or get_settings()
    now = now_s() if now is None else now
    with session_scope(settings.database_url) as session:
        schedule_ids = due_schedule_ids(session, now=now)
    runs = []
    for schedule_id in schedule_ids:
        with session_scope(settings.database_url) as session:
            run = fire_schedule(session, schedule_id=schedule_id, now=now, settings=settings)
        if run is None:
            continue
        runs.append(run)
        if run.run_id is not None:
            logger.info("schedule %s created eval run %s", schedule_id, run.run_id)
            try:
                start_run(run.run_id, settings=settings)
            except Exception:
                logger.exception("starting eval run %s of schedule %s failed", run.run_id, schedule_id)
            continue
        if run.batch_id is None:
            logger.warning("schedule %s did not create a batch: %s", schedule_id, run.error)
            continue
        logger.info("schedule %s created batch %s", schedule_id, run.batch_id)
        try:
            validate_and_start(run.batch_id, settings=settings)
        except Exception:
            logger.exception("validating batch %s of schedule %s failed", run.batch_id, schedule_id)
    return runs
