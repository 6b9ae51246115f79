"""Keyword-only data functions over batches and their lines; the caller owns the transaction.

Public functions (the API, ``jobs.intake``, ``jobs.schedules`` and the worker call them):

| function | who calls it | what it does |
|---|---|---|
| ``get_batch_input_file`` | API, schedules | the ``batch``-purpose input `File`, or raises |
| ``check_batch_params`` | API, schedules | endpoint, completion_window and metadata checks |
| ``create_batch`` | API, schedules | checks file/endpoint/window/metadata, inserts a ``validating`` batch |
| ``get_batch`` | both | the `Batch`, or raises `NotFound` |
| ``list_batches`` | API | a page of batches, newest first, after a cursor id |
| ``batches_left_validating`` | API start-up (`jobs.intake`) | batches an earlier process accepted but never validated |
| ``apply_validation`` | `jobs.intake` | inserts the lines in their shards and moves to ``in_progress``, or to ``failed`` with errors |
| ``pending_requests`` | worker | lines not run yet (of a batch or of one shard), in line order |
| ``record_result`` | worker | stores one line's result, bumps request_counts and usage |
| ``batch_status`` | worker, between steps | the committed status (to notice ``cancelling``) |
| ``is_past_expiry`` | worker, reaper | whether the completion window is over |
| ``cancel_batch`` | API | ``-> cancelling``; finalizes to ``cancelled`` at once when no worker holds a live lease |
| ``finalize_batch`` | worker, reaper, ``cancel_batch`` | writes the output/error files, stamps the terminal status |

The whole path of a line is in docs/architecture.md; shards and their leases are `jobs.shards`.

Worker protocol: claim a shard (`jobs.shards.claim_next_shard`) -> loop over its ``pending_requests``
calling ``record_result`` (commit per line or per step), checking ``batch_status`` for ``cancelling``
and ``is_past_expiry`` -> finish the shard and settle the batch (`jobs.shards.settle_batch`, which
calls ``finalize_batch`` once nothing is left). A shard run again runs only what is still pending.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, cast

from sqlalchemy import CursorResult, Result, func, insert, null, select, update
from sqlalchemy.orm import Session

from jobs.config import get_settings
from jobs.errors import InvalidRequest, NotFound
from jobs.files import get_file, write_file
from jobs.line_body import rejected_response
from jobs.models import (
    BATCH_ID_PREFIX,
    REQUEST_ID_PREFIX,
    SHARD_ID_PREFIX,
    Batch,
    BatchRequest,
    BatchShard,
    File,
    RequestState,
    ShardState,
    new_id,
)
from jobs.paging import keyset_page
from jobs.schemas import (
    COMPLETION_WINDOW,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    SUPPORTED_ENDPOINTS,
    LineError,
)
from jobs.sharding import batch_priority, plan_shards, sketch_line
from jobs.status import BatchStatus, IllegalTransition, now_s, transition
from jobs.storable_text import is_possible_id, unstorable_reason
from jobs.storage import FileStorage
from jobs.validation import ValidatedLine

INSERT_ROWS = 1000
"""Lines `apply_validation` inserts per statement (and holds in memory at once)."""
INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
_NEVER_RUN_MESSAGES = {
    BatchStatus.CANCELLED: ("batch_cancelled", "This request was not run because the batch was cancelled."),
    BatchStatus.EXPIRED: (
        "batch_expired",
        "This request was not run before the batch expired (completion window {window}).",
    ),
}


class BatchNotFinished(ValueError):
    """`finalize_batch` on an in-progress batch that still has pending lines and has not expired."""


class RequestAlreadyRecorded(ValueError):
    """`record_result` for a line that already has a result (each line is recorded exactly once)."""


def get_batch_input_file(session: Session, *, file_id: str, owner: str | None = None) -> File:
    """The stored file ``file_id`` (of API key ``owner``, when given), checked usable as a batch input.

    Raises:
        InvalidRequest: no such file (``code="file_not_found"``), or its purpose is not "batch";
            ``param="input_file_id"`` either way.
    """
    file = get_file(session, file_id=file_id, owner=owner)
    if file is None:
        raise InvalidRequest(f"no file with id {file_id!r}", param="input_file_id", code="file_not_found")
    if file.purpose != INPUT_PURPOSE:
        raise InvalidRequest(
            f"file {file_id!r} has purpose {file.purpose!r}; a batch input needs purpose 'batch'",
            param="input_file_id",
        )
    return file


def create_batch(
    session: Session,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str = COMPLETION_WINDOW,
    metadata: dict[str, str] | None = None,
    owner: str | None = None,
    now: int | None = None,
) -> Batch:
    """Insert a ``validating`` batch owned by API key ``owner`` (None: no key); ``expires_at = created_at +``
    the deployment's completion window (``Settings.completion_window``, which the batch's
    ``completion_window`` then shows).

    The input file must belong to ``owner`` too (when given).

    Raises:
        InvalidRequest: unknown input file or not of purpose "batch" (``param="input_file_id"``),
            or what `check_batch_params` rejects.
    """
    check_batch_params(endpoint=endpoint, completion_window=completion_window, metadata=metadata)
    get_batch_input_file(session, file_id=input_file_id, owner=owner)
    created_at = now_s() if now is None else now
    settings = get_settings()
    batch = Batch(
        owner_key_id=owner,
        id=new_id(BATCH_ID_PREFIX),
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=settings.completion_window,
        status=BatchStatus.VALIDATING.value,
        metadata_=metadata,
        created_at=created_at,
        expires_at=created_at + settings.completion_window_s,
        total_requests=0,
        completed_requests=0,
        failed_requests=0,
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
    )
    session.add(batch)
    session.flush()
    return batch


def check_batch_params(*, endpoint: str, completion_window: str, metadata: dict[str, str] | None) -> None:
    """Check a new batch's parameters (everything but its input file).

    Raises:
        InvalidRequest: unsupported endpoint, completion_window other than "24h" (or the deployment's
            own window), metadata over 16 pairs, a key over 64 or a value over 512 characters, a
            non-string key/value, a key or value holding a NUL character or a lone surrogate
            (`jobs.storable_text`), or a ``priority`` that is not a whole number.
    """
    if endpoint not in SUPPORTED_ENDPOINTS:
        raise InvalidRequest(
            f"endpoint {endpoint!r} is not supported; use one of {', '.join(SUPPORTED_ENDPOINTS)}", param="endpoint"
        )
    if completion_window not in (COMPLETION_WINDOW, get_settings().completion_window):
        raise InvalidRequest(
            f"completion_window must be {COMPLETION_WINDOW!r}, got {completion_window!r}", param="completion_window"
        )
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}", param="metadata")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidRequest("metadata keys and values must be strings", param="metadata")
        reason = unstorable_reason(key) or unstorable_reason(value)
        if reason is not None:
            raise InvalidRequest(f"a metadata key or value {reason}, which the service cannot store", param="metadata")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequest(
                f"metadata key {key[:16]!r}... is over {MAX_METADATA_KEY_CHARS} characters", param="metadata"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"metadata value of {key!r} is over {MAX_METADATA_VALUE_CHARS} characters", param="metadata"
            )
    try:
        batch_priority(metadata)
    except ValueError:
        raise InvalidRequest(
            f"metadata priority must be a whole number (higher runs first), got {metadata['priority']!r}",
            param="metadata",
        ) from None


def get_batch(session: Session, *, batch_id: str, for_update: bool = False, owner: str | None = None) -> Batch:
    """The batch (re-read from the database); ``for_update`` locks its row on PostgreSQL.

    Raises:
        NotFound: no batch has this id (owned by API key ``owner``, when given).
    """
    if not is_possible_id(batch_id):
        raise NotFound("batch", batch_id)
    query = select(Batch).where(Batch.id == batch_id).execution_options(populate_existing=True)
    if owner is not None:
        query = query.where(Batch.owner_key_id == owner)
    batch = session.scalar(query.with_for_update() if for_update else query)
    if batch is None:
        raise NotFound("batch", batch_id)
    return batch


def list_batches(
    session: Session, *, after: str | None = None, limit: int = 20, owner: str | None = None
) -> tuple[list[Batch], bool]:
    """A page of batches (of API key ``owner``, when given), newest first, after the batch ``after``;
    returns ``(batches, has_more)``.

    Raises:
        jobs.paging.UnknownCursor: ``after`` is not a batch id (of ``owner``).
    """
    query = select(Batch) if owner is None else select(Batch).where(Batch.owner_key_id == owner)
    return keyset_page(session, query, Batch, after=after, limit=limit, owner=owner)


def batches_left_validating(session: Session, *, created_before: int) -> list[str]:
    """Ids of batches never validated that were created before ``created_before`` (epoch s), oldest first:
    ``validating`` ones, and ``cancelling`` ones that were cancelled while validating (they end when
    their validation does)."""
    never_started = (Batch.status == BatchStatus.VALIDATING.value) | (
        (Batch.status == BatchStatus.CANCELLING.value) & Batch.in_progress_at.is_(None)
    )
    query = (
        select(Batch.id).where(never_started, Batch.created_at < created_before).order_by(Batch.created_at, Batch.id)
    )
    return list(session.scalars(query))


def apply_validation(
    session: Session,
    *,
    batch_id: str,
    lines: Iterable[ValidatedLine],
    errors: list[LineError],
    model: str,
    now: int | None = None,
    storage: FileStorage | None = None,
    num_errors: int | None = None,
) -> Batch:
    """Store the outcome of validating a batch's input file.

    ``lines`` is iterated twice (a list, or a re-iterable that streams the file again each time).
    No ``errors``: the lines cut into shards (`jobs.sharding.plan_shards`, ``Settings.shard_target_tokens``),
    one ``queued`` `BatchShard` per shard and one ``pending`` row per line, ``request_counts.total``,
    ``model`` (the model the batch is routed to), and ``validating -> in_progress``. A line with a
    ``rejection`` (its ``custom_id`` cannot be stored: ``custom_id`` null and ``custom_id_sent`` as sent;
    or its model is not served) gets its row already ``failed`` with that 400 response, and counts as
    failed. Errors: ``validating -> failed`` with ``errors``
    (``num_errors``, default ``len(errors)``, counts those not kept too), no rows.
    A batch cancelled while it was validating goes to ``cancelled`` instead (its lines, if valid,
    all reported as ``batch_cancelled``).

    Raises:
        IllegalTransition: the batch is neither validating nor cancelling (validated twice).
    """
    now = now_s() if now is None else now
    batch = get_batch(session, batch_id=batch_id, for_update=True)
    status = BatchStatus(batch.status)
    if status not in (BatchStatus.VALIDATING, BatchStatus.CANCELLING) or batch.in_progress_at is not None:
        raise IllegalTransition(status, BatchStatus.IN_PROGRESS)
    if errors:
        batch.errors = [error.model_dump() for error in errors]
        batch.num_errors = len(errors) if num_errors is None else num_errors
        if status == BatchStatus.VALIDATING:
            transition(batch, BatchStatus.FAILED, now)
            return batch
    else:
        # Two passes over ``lines``: sketches for the plan, then the rows (no body is held meanwhile).
        if iter(lines) is lines:
            raise TypeError("apply_validation iterates lines twice: pass a list or a re-iterable, not an iterator")
        shards = plan_shards([sketch_line(line) for line in lines], target_tokens=get_settings().shard_target_tokens)
        priority = batch_priority(batch.metadata_)
        shard_ids = [new_id(SHARD_ID_PREFIX) for _ in shards]
        shard_of = {n: shard_id for shard, shard_id in zip(shards, shard_ids, strict=True) for n in shard.line_numbers}
        shard_rows = [
            {
                "id": shard_id,
                "batch_id": batch_id,
                "shard_index": index,
                "num_requests": len(shard.line_numbers),
                "num_tokens": shard.num_tokens,
                "priority": priority,
                "state": ShardState.QUEUED.value,
                "attempts": 0,
                "created_at": now,
            }
            for index, (shard, shard_id) in enumerate(zip(shards, shard_ids, strict=True))
        ]
        if shard_rows:
            session.execute(insert(BatchShard), shard_rows)
        num_lines = num_rejected = 0
        line_iter = iter(lines)
        while group := list(islice(line_iter, INSERT_ROWS)):
            session.execute(insert(BatchRequest), [_request_row(batch_id, shard_of, line, now) for line in group])
            num_lines += len(group)
            num_rejected += sum(line.rejection is not None for line in group)
        batch.total_requests = num_lines
        batch.failed_requests = num_rejected
        batch.model = model
    if status == BatchStatus.CANCELLING:
        session.flush()
        return finalize_batch(session, batch_id=batch_id, now=now, storage=storage)
    transition(batch, BatchStatus.IN_PROGRESS, now)
    session.flush()
    return batch


def _request_row(batch_id: str, shard_of: dict[int, str], line: ValidatedLine, now: int) -> dict[str, Any]:
    """The ``batch_requests`` row of a validated line: pending, or failed with its 400 when rejected."""
    row: dict[str, Any] = {
        "id": new_id(REQUEST_ID_PREFIX),
        "batch_id": batch_id,
        "shard_id": shard_of[line.line_number],
        "line_number": line.line_number,
        "custom_id": line.custom_id,
        "custom_id_sent": null(),  # SQL NULL: a JSON column would store None as JSON 'null'
        "body": line.body,
        "state": RequestState.PENDING.value,
        "response": null(),
        "finished_at": None,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
    }
    rejection = line.rejection
    if rejection is not None:
        if rejection.param == "custom_id":
            row["custom_id"], row["custom_id_sent"] = None, line.custom_id
        row["state"], row["finished_at"] = RequestState.FAILED.value, now
        row["response"] = rejected_response(
            line.line_number, rejection.message, param=rejection.param, code=rejection.code
        )
    return row


def pending_requests(session: Session, *, batch_id: str, shard_id: str | None = None) -> list[BatchRequest]:
    """The batch's lines without a result (only those of ``shard_id`` when given), in line order."""
    query = select(BatchRequest).where(
        BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.PENDING.value
    )
    if shard_id is not None:
        query = query.where(BatchRequest.shard_id == shard_id)
    return list(session.scalars(query.order_by(BatchRequest.line_number)))


def record_result(
    session: Session,
    *,
    request_id: str,
    response: dict[str, Any] | None,
    error: dict[str, Any] | None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
    now: int | None = None,
) -> RequestState:
    """Store one line's result and add it to the batch's request_counts and usage.

    Args:
        request_id: the line's ``batch_req_...`` id.
        response: ``{status_code, request_id, body}`` or None; status 200 counts as completed,
            any other status (or no response) as failed.
        error: ``{code, message}`` or None (a failure with no HTTP response).
        prompt_tokens, completion_tokens, cached_tokens: the line's usage (added to the batch's).

    Returns:
        the line's new `RequestState`.

    Raises:
        ValueError: both ``response`` and ``error`` are None.
        NotFound: no line has this id.
        RequestAlreadyRecorded: the line already has a result.
    """
    if response is None and error is None:
        raise ValueError("record_result needs a response or an error")
    state = (
        RequestState.COMPLETED if response is not None and response.get("status_code") == 200 else RequestState.FAILED
    )
    batch_id = session.scalar(select(BatchRequest.batch_id).where(BatchRequest.id == request_id))
    if batch_id is None:
        raise NotFound("batch request", request_id)
    # NOTE: lock order is batch row, then line rows, as in `finalize_batch`, so the two never deadlock.
    session.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())
    recorded = num_rows_updated(
        session.execute(
            update(BatchRequest)
            .where(BatchRequest.id == request_id, BatchRequest.state == RequestState.PENDING.value)
            .values(
                state=state.value,
                response=response,
                error=error,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=cached_tokens,
                finished_at=now_s() if now is None else now,
                checkpoint_token_ids=None,
            )
            .execution_options(synchronize_session="fetch")
        )
    )
    if not recorded:
        raise RequestAlreadyRecorded(f"batch request {request_id!r} already has a result")
    counter = Batch.completed_requests if state == RequestState.COMPLETED else Batch.failed_requests
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(
            {
                counter: counter + 1,
                Batch.input_tokens: Batch.input_tokens + prompt_tokens,
                Batch.output_tokens: Batch.output_tokens + completion_tokens,
                Batch.cached_tokens: Batch.cached_tokens + cached_tokens,
            }
        )
        .execution_options(synchronize_session="fetch")
    )
    return state


def batch_status(session: Session, *, batch_id: str) -> BatchStatus:
    """The batch's status as last committed (PostgreSQL: as of this statement).

    Raises:
        NotFound: no batch has this id.
    """
    status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
    if status is None:
        raise NotFound("batch", batch_id)
    return BatchStatus(status)


def is_past_expiry(batch: Batch, now: int | None = None) -> bool:
    """True once ``now`` (Unix seconds, default the current time) reaches ``batch.expires_at``."""
    return (now_s() if now is None else now) >= batch.expires_at


def cancel_batch(
    session: Session,
    *,
    batch_id: str,
    now: int | None = None,
    storage: FileStorage | None = None,
    owner: str | None = None,
) -> Batch:
    """Cancel a batch: ``validating | in_progress -> cancelling``.

    An ``in_progress`` batch none of whose shards is held under a live lease (no worker is on it, or
    the one that was died) is finalized to ``cancelled`` at once: lines not run are reported as
    ``batch_cancelled``, finished ones kept. Otherwise each worker on it notices ``cancelling``,
    stops, and the last one finalizes (`jobs.shards.settle_batch`; the reaper does it for a worker
    that died meanwhile). A ``validating`` batch is finalized when its validation ends
    (`apply_validation`). Cancelling a cancelling or cancelled batch is a no-op.

    Raises:
        NotFound: no batch has this id (owned by API key ``owner``, when given).
        IllegalTransition: the batch is failed, completed, expired or finalizing.
    """
    now = now_s() if now is None else now
    if owner is not None or not is_possible_id(batch_id):
        get_batch(session, batch_id=batch_id, owner=owner)
    # NOTE: the conditional UPDATE comes first so that it, not a read, takes the row lock; a worker's
    # claim (which locks the batch row too) either committed before or finds the batch cancelling.
    moved = num_rows_updated(
        session.execute(
            update(Batch)
            .where(
                Batch.id == batch_id, Batch.status.in_([BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value])
            )
            .values(status=BatchStatus.CANCELLING.value, cancelling_at=now)
            .execution_options(synchronize_session=False)
        )
    )
    batch = get_batch(session, batch_id=batch_id, for_update=True)
    status = BatchStatus(batch.status)
    if not moved:
        if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return batch
        raise IllegalTransition(status, BatchStatus.CANCELLING)
    if batch.in_progress_at is not None and not has_live_lease(session, batch_id=batch_id, now=time.time()):
        return finalize_batch(session, batch_id=batch_id, now=now, storage=storage)
    return batch


def has_live_lease(session: Session, *, batch_id: str, now: float) -> bool:
    """True when a shard of the batch is ``running`` under a lease that has not lapsed at ``now`` (Unix s)."""
    query = select(BatchShard.id).where(
        BatchShard.batch_id == batch_id,
        BatchShard.state == ShardState.RUNNING.value,
        BatchShard.lease_expires_at > now,
    )
    return session.scalar(query.limit(1)) is not None


def finalize_batch(
    session: Session, *, batch_id: str, now: int | None = None, storage: FileStorage | None = None
) -> Batch:
    """Write the output and error files from the lines and stamp the terminal status.

    ``in_progress`` (no pending line) ``-> finalizing -> completed``; ``in_progress`` past
    ``expires_at`` with pending lines ``-> expired``; ``cancelling -> cancelled``. Lines never run
    get ``error = {code: "batch_cancelled" | "batch_expired", message}`` and count as failed.
    Every line lands in exactly one file: status-200 responses in the output file, the rest in the
    error file (envelope ``{id, custom_id, response, error}``, line order; ``custom_id`` as sent, even
    one the database could not hold, JSON-escaped). A file with no line is
    not created (its id stays null). Shards not finished are closed (``finished``, lease dropped), so
    a worker still on one loses its lease. Already terminal: returned unchanged (idempotent).

    Args:
        storage: where the files' bytes go (default: the settings' store, `jobs.files.default_storage`);
            they belong to the batch's owner.

    Raises:
        NotFound: no batch has this id.
        BatchNotFinished: in progress, lines pending, and not expired.
        IllegalTransition: the batch is still validating (or finalizing, a state never committed).
    """
    now = now_s() if now is None else now
    batch = get_batch(session, batch_id=batch_id, for_update=True)
    status = BatchStatus(batch.status)
    if status.is_terminal:
        return batch
    num_pending = _count_in_state(session, batch_id, RequestState.PENDING)
    if status == BatchStatus.CANCELLING:
        final = BatchStatus.CANCELLED
    elif status == BatchStatus.IN_PROGRESS and num_pending and is_past_expiry(batch, now):
        final = BatchStatus.EXPIRED
    elif status == BatchStatus.IN_PROGRESS and num_pending:
        raise BatchNotFinished(f"batch {batch_id!r} has {num_pending} pending requests and has not expired")
    elif status == BatchStatus.IN_PROGRESS:
        final = BatchStatus.COMPLETED
    else:
        raise IllegalTransition(status, BatchStatus.FINALIZING)

    if num_pending:
        code, message = _NEVER_RUN_MESSAGES[final]
        message = message.format(window=batch.completion_window)
        session.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.PENDING.value)
            .values(
                state=RequestState.FAILED.value,
                error={"code": code, "message": message},
                finished_at=now,
                checkpoint_token_ids=None,
            )
            .execution_options(synchronize_session=False)
        )
        batch.failed_requests += num_pending

    for state, attribute, suffix in (
        (RequestState.COMPLETED, "output_file_id", "output"),
        (RequestState.FAILED, "error_file_id", "error"),
    ):
        if _count_in_state(session, batch_id, state):
            file = write_file(
                session,
                chunks=_envelope_lines(session, batch_id, state),
                filename=f"{batch_id}_{suffix}.jsonl",
                purpose=OUTPUT_PURPOSE,
                storage=storage,
                owner=batch.owner_key_id,
                now=now,
            )
            setattr(batch, attribute, file.id)

    session.execute(
        update(BatchShard)
        .where(
            BatchShard.batch_id == batch_id,
            BatchShard.state.in_([ShardState.QUEUED.value, ShardState.RUNNING.value]),
        )
        .values(state=ShardState.FINISHED.value, lease_token=None, lease_expires_at=None, finished_at=now)
        .execution_options(synchronize_session=False)
    )
    if final == BatchStatus.COMPLETED:
        # NOTE: finalizing is stamped, but never committed on its own: the files are written in this transaction.
        transition(batch, BatchStatus.FINALIZING, now)
    transition(batch, final, now)
    session.flush()
    return batch


def _count_in_state(session: Session, batch_id: str, state: RequestState) -> int:
    query = (
        select(func.count())
        .select_from(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state == state.value)
    )
    return session.scalar(query) or 0


def _envelope_lines(session: Session, batch_id: str, state: RequestState) -> Iterator[bytes]:
    query = (
        select(
            BatchRequest.id,
            BatchRequest.custom_id,
            BatchRequest.custom_id_sent,
            BatchRequest.response,
            BatchRequest.error,
        )
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state == state.value)
        .order_by(BatchRequest.line_number)
        .execution_options(yield_per=1000)
    )
    for request_id, custom_id, custom_id_sent, response, error in session.execute(query):
        envelope = {
            "id": request_id,
            "custom_id": custom_id if custom_id is not None else custom_id_sent,
            "response": response,
            "error": error,
        }
        # NOTE: a lone surrogate (a custom_id kept as sent) has no UTF-8 form; inside a JSON string its
        # backslash escape is the JSON escape, so the line still parses back to what was sent.
        yield (json.dumps(envelope, ensure_ascii=False) + "\n").encode("utf-8", errors="backslashreplace")


def num_rows_updated(result: Result[Any]) -> int:
    """Rows an UPDATE matched (``session.execute`` types its result as ``Result``; an UPDATE's is a ``CursorResult``)."""
    return cast(CursorResult[Any], result).rowcount


def completed_lines(session: Session, *, model: str, limit: int) -> list[tuple[dict[str, Any], str]]:
    """Up to ``limit`` completed completions or chat lines for ``model``, newest first, as ``(request body, the
    first choice's text)`` (``batchinfer heads train --from-db``: the model's own outputs)."""
    rows = session.execute(
        select(BatchRequest.body, BatchRequest.response)
        .where(BatchRequest.state == RequestState.COMPLETED.value)
        .order_by(BatchRequest.finished_at.desc())
    )
    lines: list[tuple[dict[str, Any], str]] = []
    for body, response in rows:
        if len(lines) >= limit:
            break
        if not isinstance(body, dict) or body.get("model") != model or not response:
            continue
        choices = (response.get("body") or {}).get("choices") or []
        if not choices:
            continue
        choice = choices[0]
        text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
        if isinstance(text, str) and text:
            lines.append((body, text))
    return lines
