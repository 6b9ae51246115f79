"""Celery tasks that need no engine, both sent by beat (see `jobs.queue`): the scheduled-runs tick and
the reaper.

Registered on `jobs.queue.celery_app`, which lists this module in ``include``, so any worker of the
app runs them, the GPU worker and an engine-free ``celery -A jobs.queue:celery_app worker`` alike.
"""

from __future__ import annotations

import contextlib
from typing import Any

from kombu.exceptions import OperationalError as BrokerUnreachable

from jobs.queue import REAP, TICK_SCHEDULES, celery_app
from jobs.reaper import reap
from jobs.schedules import run_due_schedules


@celery_app.task(name=TICK_SCHEDULES)
def tick_schedules() -> list[str]:
    """Fire every due schedule (`jobs.schedules.run_due_schedules`); returns the ids of the batches created."""
    return [run.batch_id for run in run_due_schedules() if run.batch_id is not None]


@celery_app.task(name=REAP)
def reap_stranded_work() -> dict[str, Any]:
    """One reaper pass (`jobs.reaper.reap`); returns its report as a dict. When a running shard lapses
    before the next scheduled pass (a worker's heartbeat is late), one more pass is sent for that moment
    (the same queue, beat's), so a killed worker's shard does not wait out the interval."""
    report = reap()
    if report.next_pass_in_s is not None:
        with contextlib.suppress(BrokerUnreachable):
            reap_stranded_work.apply_async(countdown=report.next_pass_in_s, expires=report.next_pass_in_s + 60)
    return {
        "requeued_shards": report.requeued_shards,
        "failed_shards": report.failed_shards,
        "finalized": report.finalized,
        "messages_sent": report.messages_sent,
        "next_pass_in_s": report.next_pass_in_s,
    }
