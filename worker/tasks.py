"""Celery tasks of the worker (thin: the work lives in `worker.runner`).

Start a worker with ``batchinfer worker`` (or ``celery -A worker.tasks worker --pool=solo``).
"""

from __future__ import annotations

from jobs.queue import RUN_BATCH, celery_app
from worker import runner

__all__ = ["celery_app", "run_batch"]


@celery_app.task(name=RUN_BATCH)
def run_batch(batch_id: str) -> str | None:
    """Run every pending line of ``batch_id`` and finalize it; returns the batch's final status."""
    status = runner.run_batch(batch_id)
    return None if status is None else status.value
