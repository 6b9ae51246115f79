"""Moving an eval run along: start its batch, and send its grading work once lines have results.

1. ``start_run`` (the API, after the run's commit): validate and start the run's batch
   (`jobs.intake.validate_and_start`), ``queued -> in_progress`` (or ``failed`` when the batch's input
   was refused); a run that generates nothing goes straight to grading.
2. ``dispatch_grading`` (the worker after each shard it ends): while the batch
   runs, one ``GRADE_EVAL_SHARD`` message for the shard just finished; once the batch is terminal, one
   per shard that still has ungraded items (lines never run become item errors). With nothing left to
   grade it settles the run (`jobs.evals.repository.settle_run`). Each grading task settles too, so
   whichever ends last ends the run.

Grading an item twice is harmless (`record_grades` keeps the first), so a duplicate message costs work,
not correctness.
"""

from __future__ import annotations

import logging

from kombu.exceptions import OperationalError as BrokerUnreachable

from jobs.config import Settings, get_settings
from jobs.db import session_scope
from jobs.evals.repository import mark_run_started, run_of_batch, settle_run, units_to_grade
from jobs.intake import validate_and_start
from jobs.models import EvalRun
from jobs.queue import enqueue_grading
from jobs.repository import get_batch
from jobs.status import BatchStatus

logger = logging.getLogger(__name__)


def start_run(run_id: str, *, settings: Settings | None = None) -> None:
    """Validate and start the run's batch, then record how that went (see the module docstring).

    Raises:
        sqlalchemy.exc.OperationalError: the database is unreachable (the run stays ``queued``).
    """
    settings = settings or get_settings()
    with session_scope(settings.database_url) as session:
        run = session.get(EvalRun, run_id)
        batch_id = None if run is None else run.batch_id
    if run is None:
        return
    batch_status = None if batch_id is None else validate_and_start(batch_id, settings=settings)
    with session_scope(settings.database_url) as session:
        errors = None if batch_id is None else get_batch(session, batch_id=batch_id).errors
        mark_run_started(session, run_id=run_id, batch_status=batch_status, errors=errors)
    if batch_status is None or batch_status.is_terminal:
        dispatch_grading(run_id, settings=settings)


def dispatch_after_shard(batch_id: str, shard_id: str | None, *, settings: Settings | None = None) -> None:
    """The worker's hook after it ended a shard of ``batch_id`` (``shard_id`` None: not finished, e.g.
    handed back): grade it if the batch is an eval run's. Never raises (logged)."""
    settings = settings or get_settings()
    try:
        with session_scope(settings.database_url) as session:
            run = run_of_batch(session, batch_id=batch_id)
            run_id = None if run is None else run.id
        if run_id is not None:
            dispatch_grading(run_id, shard_id=shard_id, settings=settings)
    except Exception:
        logger.exception("could not send the grading of batch %s shard %s", batch_id, shard_id)


def dispatch_grading(run_id: str, *, shard_id: str | None = None, settings: Settings | None = None) -> list[str | None]:
    """Send the run's grading messages (see the module docstring); returns the units sent. A broker
    that is down is logged, not raised."""
    settings = settings or get_settings()
    with session_scope(settings.database_url) as session:
        run = session.get(EvalRun, run_id)
        if run is None:
            return []
        batch_done = run.batch_id is None or BatchStatus(get_batch(session, batch_id=run.batch_id).status).is_terminal
        units = units_to_grade(session, run_id=run_id)
        model = run.model
        if not batch_done:
            units = [unit for unit in units if unit is not None and unit == shard_id]
        if not units:
            if batch_done:
                settle_run(session, run_id=run_id)
            return []
    try:
        enqueue_grading(run_id, units, model=model, broker_url=settings.broker_url)
    except BrokerUnreachable as exc:
        logger.warning("eval run %s: broker unreachable (%s); its grading waits for the reaper", run_id, exc)
    return units
