"""Validate a new batch's input file and start it: the step between ``POST /v1/batches`` and the worker.

Runs in the API process right after the batch is created (FastAPI background task): stream the
input file through the checks (`jobs.validation`), then in one transaction either insert the lines
(a second streaming pass) in their shards and move to ``in_progress``, or move to ``failed`` with every
error; send one ``RUN_SHARD`` message per shard only after that commit, so a worker always finds the
lines. A broker that is down then is logged, not raised: the shards are committed, and the reaper sends
their messages once the broker answers again (`jobs.reaper`). The checking pass runs outside any
database transaction (a 200 MB file takes a while; SQLite would be locked meanwhile). Neither pass
holds the file in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

from kombu.exceptions import OperationalError as BrokerUnreachable
from sqlalchemy import func, select
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from jobs.config import Settings, get_settings
from jobs.db import session_scope
from jobs.errors import NotFound
from jobs.files import file_chunks, get_file
from jobs.models import BatchShard, File
from jobs.queue import enqueue_shards
from jobs.repository import apply_validation, batches_left_validating, get_batch
from jobs.schemas import LineError
from jobs.status import BatchStatus, IllegalTransition, now_s
from jobs.storage import FileStorage, storage_from_settings
from jobs.validation import ValidatedLine, ValidationResult, validate_batch_file, validated_lines

logger = logging.getLogger(__name__)


def validate_and_start(batch_id: str, *, settings: Settings | None = None) -> BatchStatus:
    """Validate batch ``batch_id`` (status ``validating``) and start it; returns its new status.

    ``in_progress`` (its shards queued; their messages sent unless the broker is unreachable, in
    which case the reaper sends them later), ``failed`` (``errors`` set; an unreadable or deleted
    input file gives one ``file_not_found`` error) or ``cancelled`` (cancelled while validating).

    A validation that raises anything else (a bug) does not leave the batch ``validating``: it is
    logged and the batch ends ``failed`` with one ``internal_error`` (``cancelled`` if it was being
    cancelled). Only an unreachable database leaves it as it was, for `resume_validating_batches`.

    Raises:
        jobs.errors.NotFound: no such batch.
        jobs.status.IllegalTransition: the batch was already validated.
        sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError: the database is unreachable.
    """
    settings = settings or get_settings()
    try:
        status, num_lines, num_shards, num_errors, model = _validate(batch_id, settings)
    except (NotFound, IllegalTransition, OperationalError, InterfaceError):
        raise
    except Exception as exc:
        logger.exception("validating batch %s raised; the batch fails with internal_error", batch_id)
        message = f"the input file could not be validated: the service hit an unexpected {type(exc).__name__}"
        error = LineError(code="internal_error", message=message)
        with session_scope(settings.database_url) as session:
            batch = apply_validation(
                session,
                batch_id=batch_id,
                lines=(),
                errors=[error],
                model=settings.served_model_name,
                storage=storage_from_settings(settings),
            )
            return BatchStatus(batch.status)
    logger.info(
        "batch %s validated: %s (%d lines in %d shards, %d errors; model %s)",
        batch_id,
        status,
        num_lines,
        num_shards,
        num_errors,
        model,
    )
    if status == BatchStatus.IN_PROGRESS:
        try:
            enqueue_shards(num_shards, model=model, broker_url=settings.broker_url)
        except BrokerUnreachable as exc:
            logger.warning("batch %s: broker unreachable (%s); the reaper will queue its shards", batch_id, exc)
    return status


def _validate(batch_id: str, settings: Settings) -> tuple[BatchStatus, int, int, int, str]:
    """Check the batch's file and store the outcome (`apply_validation`); returns the new status, the
    numbers of lines, shards and errors, and the model the batch is routed to."""
    storage = storage_from_settings(settings)
    model_names = settings.aliases
    with session_scope(settings.database_url) as session:
        batch = get_batch(session, batch_id=batch_id)
        endpoint, input_file_id = batch.endpoint, batch.input_file_id
        file = get_file(session, file_id=input_file_id)
    try:
        if file is None:
            raise FileNotFoundError(input_file_id)
        result = validate_input_file(file, endpoint=endpoint, settings=settings, storage=storage)
    except OSError:
        message = f"the input file {input_file_id!r} no longer exists or cannot be read"
        result = ValidationResult(errors=[LineError(code="file_not_found", message=message, param="input_file_id")])
    # NOTE: a file none of whose lines names a served model has only rejected lines; the default
    # model's workers close it.
    model = result.model or settings.served_model_name
    with session_scope(settings.database_url) as session:
        # NOTE: the second pass reads inside this transaction: SQLite's BEGIN IMMEDIATE would block a
        # reader on a connection of its own (database storage) until this transaction ends.
        lines: Iterable[ValidatedLine] = (
            _FileLines(lambda: file_chunks(file, storage=storage, session=session), endpoint, model_names)
            if result.ok and file is not None
            else ()
        )
        batch = apply_validation(
            session,
            batch_id=batch_id,
            lines=lines,
            errors=result.errors,
            num_errors=result.num_errors,
            model=model,
            storage=storage,
        )
        status = BatchStatus(batch.status)
        num_shards = session.scalar(select(func.count()).where(BatchShard.batch_id == batch_id)) or 0
    return status, result.num_lines, num_shards, result.num_errors, model


def validate_input_file(
    file: File, *, endpoint: str, settings: Settings, storage: FileStorage, session: Session | None = None
) -> ValidationResult:
    """The structure checks of `jobs.validation` on stored ``file`` as a batch of ``endpoint``, against the
    served models and the deployment's file limits (``session``: read in that transaction).

    Raises:
        FileNotFoundError: the file's bytes are gone.
    """
    return validate_batch_file(
        file_chunks(file, storage=storage, session=session),
        endpoint=endpoint,
        model_names=settings.aliases,
        max_lines=settings.max_file_lines,
        max_bytes=settings.max_file_bytes,
    )


class _FileLines:
    """The validated lines of a file, streamed from storage again at each iteration (a re-iterable)."""

    def __init__(self, chunks: Callable[[], Iterable[bytes]], endpoint: str, model_names: Mapping[str, str]) -> None:
        self._chunks, self._endpoint, self._model_names = chunks, endpoint, model_names

    def __iter__(self) -> Iterator[ValidatedLine]:
        return iter(validated_lines(self._chunks(), endpoint=self._endpoint, model_names=self._model_names))


def resume_validating_batches(*, settings: Settings | None = None, started_at: int | None = None) -> list[str]:
    """Validate and start every batch an earlier API process left in ``validating`` (it stopped between
    creating a batch and validating it), so no accepted batch is lost; one cancelled meanwhile (left
    ``cancelling``) ends ``cancelled`` this way.

    Only batches created before ``started_at`` (default: now) are taken, so batches created by this
    process meanwhile are left to their own background task. A batch that fails (another process got
    there first, the broker is down) is logged and skipped.

    Returns:
        The ids of the batches taken, oldest first.
    """
    settings = settings or get_settings()
    with session_scope(settings.database_url) as session:
        batch_ids = batches_left_validating(session, created_before=now_s() if started_at is None else started_at)
    for batch_id in batch_ids:
        try:
            validate_and_start(batch_id, settings=settings)
        except Exception:
            logger.exception("could not resume the validation of batch %s", batch_id)
    return batch_ids
