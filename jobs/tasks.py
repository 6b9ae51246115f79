"""Celery tasks that need no engine: the scheduled-runs tick, sent by beat (see `jobs.queue`).

Registered on `jobs.queue.celery_app`, which lists this module in ``include``, so any worker of the
app runs it, the GPU worker and an engine-free ``celery -A jobs.queue:celery_app worker`` alike.
"""

from __future__ import annotations

from jobs.queue import TICK_SCHEDULES, celery_app
from jobs.schedules import run_due_schedules


@celery_app.task(name=TICK_SCHEDULES)
def tick_schedules() -> list[str]:
    """Fire every due schedule (`jobs.schedules.run_due_schedules`); returns the ids of the batches created."""
    return [run.batch_id for run in run_due_schedules() if run.batch_id is not None]
