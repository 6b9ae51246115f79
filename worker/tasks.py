"""Celery tasks of the worker (thin: the work lives in `worker.runner`).

Start a worker with ``batchinfer worker`` (or ``celery -A worker.tasks worker --pool=solo``).
"""

from __future__ import annotations

from typing import Any

from celery.signals import worker_ready

from jobs.queue import RUN_SHARD, celery_app
from worker import runner, shutdown

__all__ = ["celery_app", "run_shard"]


@celery_app.task(name=RUN_SHARD)
def run_shard() -> dict[str, Any] | None:
    """Claim the next queued shard of a batch of this worker's model and run it (`worker.runner.run_next_shard`); a stop
    signal meanwhile hands the shard back (`worker.shutdown`). Returns what happened, or None when no
    shard was waiting (a surplus message)."""
    if shutdown.requested.is_set():
        return None  # stopping: claim nothing (the reaper replaces this message for whoever runs next)
    with shutdown.running_shard() as stop:
        run = runner.run_next_shard(stop=stop)
    if run is None:
        return None
    return {"shard_id": run.shard_id, "batch_id": run.batch_id, "end": run.end.value, "batch": run.batch_status.value}


@worker_ready.connect
def _install_stop_handlers(**_kwargs: Any) -> None:
    # NOTE: after Celery installed its own signal handlers, which ours wrap.
    shutdown.install()
