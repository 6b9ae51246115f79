"""Celery tasks of the worker (thin: the work lives in `worker.runner`).

Start a worker with ``batchinfer worker`` (or ``celery -A worker.tasks worker --pool=solo``).
"""

from __future__ import annotations

from worker.cpu_threads import use_bounded_wait

# NOTE: before anything below imports torch: ``celery -A worker.tasks worker`` starts here, not in
# ``batchinfer worker``, and libgomp reads its wait policy once, when torch loads it (worker/cpu_threads.py).
use_bounded_wait()

from typing import Any

from celery.signals import worker_ready

from jobs.evals.dispatch import dispatch_after_shard
from jobs.queue import GRADE_EVAL_SHARD, RUN_SHARD, celery_app
from worker import eval_grading, runner, shutdown
from worker.grading.engine_grader import EngineModelGrader
from worker.runner import ShardEnd

__all__ = ["celery_app", "grade_eval_shard", "run_shard"]


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
    # An eval run's batch: grade the shard just finished (or all that is left, once the batch ended).
    dispatch_after_shard(run.batch_id, run.shard_id if run.end == ShardEnd.FINISHED else None)
    return {"shard_id": run.shard_id, "batch_id": run.batch_id, "end": run.end.value, "batch": run.batch_status.value}


@celery_app.task(name=GRADE_EVAL_SHARD)
def grade_eval_shard(run_id: str, shard_id: str | None) -> dict[str, Any]:
    """Grade one shard of an eval run (`worker.eval_grading.grade_shard`; model graders ask this worker's
    engine, loaded only if one does); returns the items graded and the run's status afterwards."""
    graded = eval_grading.grade_shard(run_id, shard_id, model_grader=EngineModelGrader)
    return {"run_id": run_id, "shard_id": shard_id, "graded": graded.num_graded, "run": graded.run_status}


@worker_ready.connect
def _install_stop_handlers(**_kwargs: Any) -> None:
    # NOTE: after Celery installed its own signal handlers, which ours wrap.
    shutdown.install()
