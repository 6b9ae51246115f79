"""The reaper: what beat does every ``Settings.reaper_interval_s`` so that no accepted batch is stranded.

One pass (`reap`), each step in its own short transactions, every step safe to run twice or
from two beat processes at once:

1. **Lapsed leases.** A ``running`` shard whose lease lapsed (its worker was killed, hung, or lost
   the database), or whose worker's heartbeat is older than ``Settings.worker_dead_s`` (its worker
   was killed: taken back without waiting for the lease to expire), goes back to ``queued``; on its
   ``shard_max_attempts``-th loss it ``failed`` and its pending lines get ``shard_failed`` errors
   (`jobs.shards.reclaim_lapsed_shard`). A killed worker's shard is therefore queued again at most
   ``worker_dead_s + worker_heartbeat_s`` (+1 s: heartbeats are whole seconds) after the kill (16 s
   with the defaults), thanks to step 4; ``reaper_interval_s`` more if that extra pass is lost.
2. **Settling.** A batch past ``expires_at`` is finalized ``expired`` whether or not a worker ever
   took it (finished lines stay in the output file, the rest go to the error file as
   ``batch_expired``); a ``cancelling`` batch nobody holds a live lease on is finalized
   ``cancelled``; an ``in_progress`` batch with nothing left to run is finalized ``completed``
   (`jobs.shards.settle_batch`). A batch of an eval run finalized here gets its grading messages
   (`jobs.evals.dispatch`), as a worker sends them after the shards it ends.
3. **Messages.** Each model's work queue (`jobs.queue.work_queue`) is topped up to one message per
   claimable shard of that model's batches: shards whose message
   never reached the broker (it was down when the batch was validated), or was lost with a killed
   worker, reach a worker within one interval of the broker answering. A shard taken back in step 1
   gets its message in the same pass, so an idle worker claims it at once; a busy one after its
   current shard (``worker_prefetch_multiplier = 1`` with late acks: a worker never holds a message
   it is not running, see `jobs.queue`).

4. **A closer next pass.** When a running shard would lapse before the next scheduled pass (its
   holder's heartbeat is already late: it becomes ``worker_dead_s`` old sooner than
   ``reaper_interval_s`` from now; or its lease expires sooner), the pass reports when
   (`ReapReport.next_pass_in_s`) and the task sends one extra pass for that moment (`jobs.tasks`). A
   killed worker's shard is then queued again ``worker_dead_s`` after its last heartbeat, not up to one
   interval later: 10-16 s after the kill with the defaults.

Database or broker trouble in a step is logged and the pass goes on; the next pass retries.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kombu.exceptions import OperationalError as BrokerUnreachable
from sqlalchemy.exc import SQLAlchemyError

from jobs.config import Settings, get_settings
from jobs.db import session_scope
from jobs.evals.dispatch import dispatch_after_shard
from jobs.queue import enqueue_shards, num_waiting_messages, work_queue
from jobs.shards import (
    batches_to_settle,
    lapsed_shards,
    next_lapse_at,
    num_queued_shards,
    reclaim_lapsed_shard,
    settle_batch,
)
from jobs.status import BatchStatus
from jobs.storage import storage_from_settings

logger = logging.getLogger(__name__)

_LAPSE_MARGIN_S = 0.5


@dataclass(slots=True)
class ReapReport:
    """What one pass did: shards re-queued and failed, batches finalized (id -> status), messages sent;
    ``next_pass_in_s``: seconds until a running shard lapses when that is sooner than the next scheduled
    pass (else None; step 4 of the module docstring)."""

    requeued_shards: list[str] = field(default_factory=list)
    failed_shards: list[str] = field(default_factory=list)
    finalized: dict[str, str] = field(default_factory=dict)
    messages_sent: int = 0
    next_pass_in_s: float | None = None


def reap(*, settings: Settings | None = None, now: float | None = None) -> ReapReport:
    """One reaper pass (see the module docstring); ``now`` is Unix seconds (default the current time)."""
    settings = settings or get_settings()
    now = time.time() if now is None else now
    report = ReapReport()
    try:
        _reclaim(settings, now, report)
        _settle(settings, now, report)
        report.next_pass_in_s = _next_pass_in_s(settings, now)
    except SQLAlchemyError as exc:
        logger.warning("reaper: database unreachable (%s); retrying next pass", exc)
        return report
    try:
        _top_up(settings, now, report)
    except BrokerUnreachable as exc:
        logger.warning("reaper: broker unreachable (%s); retrying next pass", exc)
    except SQLAlchemyError as exc:
        logger.warning("reaper: database unreachable (%s); retrying next pass", exc)
    return report


def _reclaim(settings: Settings, now: float, report: ReapReport) -> None:
    dead_before = now - settings.worker_dead_s
    with session_scope(settings.database_url) as session:
        lapsed = lapsed_shards(session, now=now, dead_before=dead_before)
    for shard_id, batch_id in lapsed:
        with session_scope(settings.database_url) as session:
            taken = reclaim_lapsed_shard(
                session,
                shard_id=shard_id,
                batch_id=batch_id,
                now=now,
                max_attempts=settings.shard_max_attempts,
                dead_before=dead_before,
            )
        if taken is None:
            continue
        (report.failed_shards if taken.failed else report.requeued_shards).append(shard_id)
        logger.warning(
            "reaper: shard %s (batch %s): %s; %s",
            shard_id,
            batch_id,
            f"its worker {taken.owner} stopped its heartbeat {settings.worker_dead_s:g}+ s ago"
            if taken.owner_dead
            else f"the lease held by {taken.owner} lapsed",
            "its remaining lines failed" if taken.failed else "queued again",
        )


def _next_pass_in_s(settings: Settings, now: float) -> float | None:
    with session_scope(settings.database_url) as session:
        lapse_at = next_lapse_at(session, worker_dead_s=settings.worker_dead_s)
    if lapse_at is None:
        return None
    # NOTE: lapsing is a strict comparison on whole-second timestamps; half a second later it has lapsed.
    in_s = max(lapse_at - now, 0.0) + _LAPSE_MARGIN_S
    return in_s if in_s < settings.reaper_interval_s else None


def _settle(settings: Settings, now: float, report: ReapReport) -> None:
    with session_scope(settings.database_url) as session:
        batch_ids = batches_to_settle(session, now=now)
    for batch_id in batch_ids:
        with session_scope(settings.database_url) as session:
            status = settle_batch(session, batch_id=batch_id, now=now, storage=storage_from_settings(settings))
        if status.is_terminal:
            report.finalized[batch_id] = status.value
            logger.info("reaper: batch %s finalized %s", batch_id, status.value)
            dispatch_after_shard(batch_id, None, settings=settings)
        elif status == BatchStatus.IN_PROGRESS:
            logger.debug("reaper: batch %s still has lines to run", batch_id)


def _top_up(settings: Settings, now: float, report: ReapReport) -> None:
    with session_scope(settings.database_url) as session:
        queued_by_model = num_queued_shards(session, now=now)
    for model, num_queued in sorted(queued_by_model.items()):
        missing = num_queued - num_waiting_messages(broker_url=settings.broker_url, queue=work_queue(model))
        if missing > 0:
            report.messages_sent += enqueue_shards(missing, model=model, broker_url=settings.broker_url)
            logger.info(
                "reaper: %d queued shards of model %s had no message waiting; sent %d", num_queued, model, missing
            )
