"""Shards under leases: which worker runs which part of which batch, and what happens when one is lost.

A batch's lines are cut into shards at validation (`jobs.sharding`, `jobs.repository.apply_validation`).
A worker *claims* the next shard (`claim_next_shard`) and holds it under a *lease* in the database:
a random token, the worker's id and an expiry time, renewed every ``Settings.lease_renew_s`` and
lapsing ``Settings.lease_expiry_s`` after the last renewal. The lease, not the broker message, says
who works on a shard, so a killed worker costs one lease expiry, not the broker's visibility timeout:

```
queued --claim--> running --every line recorded--> finished
   ^                 |  \\--graceful stop: hand back (attempt not counted)--> queued
   |                 |   \\--batch cancelled / expired: released; finalize closes it--> finished
   +--lease lapsed---+   (reaper; the attempt counted)
   +--holder dead----+   (reaper: the holder's heartbeat stopped; the attempt counted)
                     +--lease lapsed / holder dead on the last attempt--> failed (remaining lines: `shard_failed` errors)
```

A lease is *lapsed* when its expiry passed, or when its holder is *dead*: the holder's row in the
``workers`` table (`jobs.workers`) has a heartbeat older than the reaper's ``dead_before`` (its
process was killed; a worker writes its row every ``Settings.worker_heartbeat_s``). The second rule
lets the reaper take a killed worker's shard back a few heartbeats after the kill instead of a whole
lease expiry later; a holder with no row at all (a runner without a heartbeat) is judged by its
lease's expiry alone, and a live holder's heartbeat keeps it from ever being reclaimed early.

Routing: a worker serves one model and claims only shards of that model's batches (``batches.model``,
set at validation to the model every line names). Fair share: `claim_next_shard` takes the queued
shard of the highest ``priority``, then of the batch with the fewest shards running, then of the
oldest batch, then the lowest shard index. Several batches therefore progress side by side, and a
batch submitted behind a 100,000-line one gets the next free worker.

Data functions are keyword-only and leave the transaction to the caller; every function that
changes a batch's counts or status locks the batch row first (the same order as
`jobs.repository.record_result` and `finalize_batch`), so no two of them deadlock. Times are Unix
seconds: float for lease expiries, whole seconds for the stamps the API shows.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.orm import Session

from jobs.models import Batch, BatchRequest, BatchShard, RequestState, ShardState, Worker
from jobs.repository import finalize_batch, get_batch, has_live_lease, is_past_expiry, num_rows_updated
from jobs.status import BatchStatus
from jobs.storage import FileStorage

SHARD_FAILED = "shard_failed"
_CLAIM_TRIES = 8


@dataclass(frozen=True, slots=True)
class Lease:
    """A worker's hold on one shard: present ``token`` to renew, finish or hand back the shard."""

    shard_id: str
    batch_id: str
    token: str
    owner: str
    endpoint: str
    batch_expires_at: int


@dataclass(frozen=True, slots=True)
class LapsedShard:
    """A shard whose lease the reaper found lapsed: back in the queue, or failed for good.
    ``owner_dead``: taken back because its holder's heartbeat stopped (its lease had not expired yet)."""

    shard_id: str
    batch_id: str
    owner: str | None
    failed: bool
    owner_dead: bool = False


def claim_next_shard(
    session: Session, *, owner: str, now: float, lease_s: float, model: str | None = None
) -> Lease | None:
    """Lease the next queued shard (fair-share order, see the module docstring) to ``owner``.

    Only shards of ``in_progress`` batches whose window is still open are claimed, and only of batches
    for ``model`` when given. The claim counts one attempt and stamps the batch's ``started_at`` the
    first time.

    Args:
        owner: the worker's id (``host:pid``).
        now: Unix seconds; the lease lapses at ``now + lease_s`` unless renewed.
        model: the name of the model the worker serves (None: any batch).

    Returns:
        The lease, or None when no shard is waiting.
    """
    running = (
        select(BatchShard.batch_id, func.count().label("num_running"))
        .where(BatchShard.state == ShardState.RUNNING.value)
        .group_by(BatchShard.batch_id)
        .subquery()
    )
    candidates = (
        select(BatchShard.id, BatchShard.batch_id)
        .join(Batch, Batch.id == BatchShard.batch_id)
        .outerjoin(running, running.c.batch_id == BatchShard.batch_id)
        .where(
            BatchShard.state == ShardState.QUEUED.value,
            Batch.status == BatchStatus.IN_PROGRESS.value,
            Batch.expires_at > now,
            *(() if model is None else (Batch.model == model,)),
        )
        .order_by(
            BatchShard.priority.desc(),
            func.coalesce(running.c.num_running, 0),
            Batch.created_at,
            Batch.id,
            BatchShard.shard_index,
        )
        .limit(1)
    )
    for _ in range(_CLAIM_TRIES):
        row = session.execute(candidates).first()
        if row is None:
            return None
        shard_id, batch_id = row
        # NOTE: the batch row is locked before the shard row, as everywhere; a cancel that committed
        # meanwhile is seen here and the shard is not claimed.
        batch = get_batch(session, batch_id=batch_id, for_update=True)
        if batch.status != BatchStatus.IN_PROGRESS.value or is_past_expiry(batch, int(now)):
            continue
        token = secrets.token_hex(16)
        claimed = num_rows_updated(
            session.execute(
                update(BatchShard)
                .where(BatchShard.id == shard_id, BatchShard.state == ShardState.QUEUED.value)
                .values(
                    state=ShardState.RUNNING.value,
                    lease_token=token,
                    lease_owner=owner,
                    lease_expires_at=now + lease_s,
                    attempts=BatchShard.attempts + 1,
                )
                .execution_options(synchronize_session=False)
            )
        )
        if not claimed:
            continue
        if batch.started_at is None:
            batch.started_at = int(now)
        return Lease(shard_id, batch_id, token, owner, batch.endpoint, batch.expires_at)
    return None


def renew_lease(session: Session, *, lease: Lease, now: float, lease_s: float) -> bool:
    """Push the lease's expiry to ``now + lease_s``; False when the lease is no longer held (it lapsed
    and the shard went to another worker, or the batch was finalized): the worker must stop."""
    return bool(
        num_rows_updated(
            session.execute(
                update(BatchShard)
                .where(
                    BatchShard.id == lease.shard_id,
                    BatchShard.lease_token == lease.token,
                    BatchShard.state == ShardState.RUNNING.value,
                )
                .values(lease_expires_at=now + lease_s)
                .execution_options(synchronize_session=False)
            )
        )
    )


def holds_lease(session: Session, *, lease: Lease) -> bool:
    """True while the shard is ``running`` under this lease's token."""
    query = select(BatchShard.id).where(
        BatchShard.id == lease.shard_id,
        BatchShard.lease_token == lease.token,
        BatchShard.state == ShardState.RUNNING.value,
    )
    return session.scalar(query) is not None


def finish_shard(session: Session, *, lease: Lease, now: int) -> bool:
    """``running -> finished`` (every line of the shard has its result); False when the lease was lost."""
    get_batch(session, batch_id=lease.batch_id, for_update=True)
    return _end_lease(session, lease, state=ShardState.FINISHED, finished_at=now)


def hand_back_shard(session: Session, *, lease: Lease) -> bool:
    """``running -> queued`` without counting the attempt (a graceful stop, or the batch stopped);
    the shard's finished lines stay recorded. False when the lease was already lost."""
    get_batch(session, batch_id=lease.batch_id, for_update=True)
    return _end_lease(session, lease, state=ShardState.QUEUED, attempts=BatchShard.attempts - 1)


def _end_lease(session: Session, lease: Lease, *, state: ShardState, **values: object) -> bool:
    query = (
        update(BatchShard)
        .where(
            BatchShard.id == lease.shard_id,
            BatchShard.lease_token == lease.token,
            BatchShard.state == ShardState.RUNNING.value,
        )
        .values(state=state.value, lease_token=None, lease_owner=None, lease_expires_at=None, **values)
        .execution_options(synchronize_session=False)
    )
    return bool(num_rows_updated(session.execute(query)))


def _is_lapsed(now: float, dead_before: float | None) -> ColumnElement[bool]:
    """A ``running`` shard whose lease expired before ``now``, or whose holder's heartbeat is older than
    ``dead_before`` (Unix seconds; None: expiry only)."""
    expired = BatchShard.lease_expires_at < now
    if dead_before is None:
        return (BatchShard.state == ShardState.RUNNING.value) & expired
    dead = BatchShard.lease_owner.in_(select(Worker.id).where(Worker.last_heartbeat_at < dead_before))
    return (BatchShard.state == ShardState.RUNNING.value) & (expired | dead)


def lapsed_shards(session: Session, *, now: float, dead_before: float | None = None) -> list[tuple[str, str]]:
    """``(shard_id, batch_id)`` of every ``running`` shard whose lease lapsed before ``now`` or whose
    holder's last heartbeat is older than ``dead_before`` (see the module docstring)."""
    query = select(BatchShard.id, BatchShard.batch_id).where(_is_lapsed(now, dead_before))
    return [(shard_id, batch_id) for shard_id, batch_id in session.execute(query.order_by(BatchShard.id))]


def next_lapse_at(session: Session, *, worker_dead_s: float) -> float | None:
    """The earliest moment (Unix seconds) a ``running`` shard would lapse if nothing changed: its lease
    expires, or its holder's last heartbeat becomes ``worker_dead_s`` old. None when no shard runs."""
    expires = session.scalar(
        select(func.min(BatchShard.lease_expires_at)).where(BatchShard.state == ShardState.RUNNING.value)
    )
    last_beat = session.scalar(
        select(func.min(Worker.last_heartbeat_at))
        .join(BatchShard, BatchShard.lease_owner == Worker.id)
        .where(BatchShard.state == ShardState.RUNNING.value)
    )
    moments = [float(t) for t in (expires, None if last_beat is None else last_beat + worker_dead_s) if t is not None]
    return min(moments, default=None)


def reclaim_lapsed_shard(
    session: Session,
    *,
    shard_id: str,
    batch_id: str,
    now: float,
    max_attempts: int,
    dead_before: float | None = None,
) -> LapsedShard | None:
    """Take back one shard whose lease lapsed (its worker died, hung or lost the database) or whose
    holder's heartbeat is older than ``dead_before`` (its worker was killed).

    Below ``max_attempts`` claims the shard is ``queued`` again; at ``max_attempts`` it is
    ``failed`` and each of its lines still pending gets the error ``shard_failed`` (counted as
    failed), so the batch can still end. None when the lease was renewed or ended meanwhile (or the
    holder's heartbeat came back).
    """
    get_batch(session, batch_id=batch_id, for_update=True)
    shard = session.scalar(
        select(BatchShard)
        .where(BatchShard.id == shard_id, _is_lapsed(now, dead_before))
        .execution_options(populate_existing=True)
    )
    if shard is None:
        return None
    owner, failed = shard.lease_owner, shard.attempts >= max_attempts
    owner_dead = shard.lease_expires_at is not None and shard.lease_expires_at >= now
    shard.state = (ShardState.FAILED if failed else ShardState.QUEUED).value
    shard.lease_token = shard.lease_owner = shard.lease_expires_at = None
    if failed:
        shard.finished_at = int(now)
        message = (
            f"This request was not run: the worker running its shard was lost {shard.attempts} times "
            "(killed, out of memory, or cut off from the database)."
        )
        num_failed = num_rows_updated(
            session.execute(
                update(BatchRequest)
                .where(BatchRequest.shard_id == shard_id, BatchRequest.state == RequestState.PENDING.value)
                .values(
                    state=RequestState.FAILED.value,
                    error={"code": SHARD_FAILED, "message": message},
                    finished_at=int(now),
                    checkpoint_token_ids=None,
                )
                .execution_options(synchronize_session=False)
            )
        )
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(failed_requests=Batch.failed_requests + num_failed)
            .execution_options(synchronize_session=False)
        )
    session.flush()
    return LapsedShard(shard_id, batch_id, owner, failed, owner_dead)


def settle_batch(session: Session, *, batch_id: str, now: float, storage: FileStorage | None = None) -> BatchStatus:
    """Finalize the batch when nothing is left to run; returns its status afterwards.

    ``in_progress`` with no pending line -> ``completed``; ``in_progress`` past its window ->
    ``expired`` (workers still on it lose their leases); ``cancelling`` with no live lease ->
    ``cancelled``. Anything else is left alone. The batch row is locked first, so of two workers
    ending their last shards at once exactly one finalizes.
    """
    batch = get_batch(session, batch_id=batch_id, for_update=True)
    status = BatchStatus(batch.status)
    if status == BatchStatus.IN_PROGRESS:
        num_pending = session.scalar(
            select(func.count())
            .select_from(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.PENDING.value)
        )
        if num_pending and not is_past_expiry(batch, int(now)):
            _requeue_unfinished_shards(session, batch_id=batch_id)
            return status
    elif status != BatchStatus.CANCELLING or has_live_lease(session, batch_id=batch_id, now=now):
        return status
    return BatchStatus(finalize_batch(session, batch_id=batch_id, now=int(now), storage=storage).status)


def _requeue_unfinished_shards(session: Session, *, batch_id: str) -> None:
    """Put back in the queue any ``finished`` shard that still has a pending line (its worker ended it
    without recording every line), so no pending line is left without a shard to run it."""
    unfinished = (
        select(BatchRequest.shard_id)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.PENDING.value)
        .distinct()
    )
    session.execute(
        update(BatchShard)
        .where(BatchShard.id.in_(unfinished), BatchShard.state == ShardState.FINISHED.value)
        .values(state=ShardState.QUEUED.value, finished_at=None)
        .execution_options(synchronize_session=False)
    )


def batches_to_settle(session: Session, *, now: float) -> list[str]:
    """Batches the reaper should try to settle: ``in_progress`` past their window, ``in_progress`` with
    no shard left to run, and every ``cancelling`` batch that has shards (oldest first)."""
    open_shards = (
        select(BatchShard.batch_id)
        .where(BatchShard.state.in_([ShardState.QUEUED.value, ShardState.RUNNING.value]))
        .distinct()
    )
    query = select(Batch.id).where(
        ((Batch.status == BatchStatus.IN_PROGRESS.value) & ((Batch.expires_at <= now) | Batch.id.not_in(open_shards)))
        | ((Batch.status == BatchStatus.CANCELLING.value) & (Batch.in_progress_at.is_not(None)))
    )
    return list(session.scalars(query.order_by(Batch.created_at, Batch.id)))


def num_queued_shards(session: Session, *, now: float) -> dict[str, int]:
    """Queued shards a worker could claim now (their batch ``in_progress``, its window open), by the
    batch's model (only models with at least one)."""
    query = (
        select(Batch.model, func.count())
        .select_from(BatchShard)
        .join(Batch, Batch.id == BatchShard.batch_id)
        .where(
            BatchShard.state == ShardState.QUEUED.value,
            Batch.status == BatchStatus.IN_PROGRESS.value,
            Batch.expires_at > now,
        )
        .group_by(Batch.model)
    )
    return {model: count for model, count in session.execute(query) if model is not None}
