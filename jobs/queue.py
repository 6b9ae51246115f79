"""The Celery app and task names. The API enqueues by name; the worker defines the tasks.

Broker: ``settings.broker_url`` (Redis in production; the embedded default is kombu's SQLAlchemy
transport over a SQLite file, ``sqla+sqlite:///{data_dir}/broker.db``, whose directory is created
here).

Work messages carry no data: each ``RUN_SHARD`` message asks a worker to claim the next queued shard
of its model (`jobs.shards.claim_next_shard`, fair across that model's batches), so which shard runs
is decided in the database, and the lease there, not the message, says who holds it. Each configured
model has its own work queue (`work_queue`), consumed only by the workers serving that model
(``batchinfer worker --model NAME``). The API sends one message per shard after validation to the
batch's model's queue; the reaper tops each model's queue up to that model's queued shards, so a
message lost with a killed worker, or never sent because the broker was down, costs one reaper interval.
``task_acks_late`` with ``worker_prefetch_multiplier = 1`` keeps a busy solo worker from reserving
messages it cannot run; a surplus message finds nothing to claim and ends at once.

Beat (``batchinfer beat``: a light worker with an embedded beat, no engine) sends ``TICK_SCHEDULES``
every ``SCHEDULE_TICK_S`` seconds and ``REAP`` every ``Settings.reaper_interval_s`` on its own
``SCHEDULES_QUEUE``, so neither waits behind a shard on an engine worker (those consume only the
model queues). ``GRADE_EVAL_SHARD`` messages (an eval run's shard to grade, `jobs.evals.dispatch`) carry
``(run_id, shard_id)`` and go to the work queue of the run's model: model graders need a worker with an
engine (`worker.tasks`). The tasks live in `jobs.tasks`; a tick message expires after one interval, so missed
ticks are dropped, not replayed.
"""

from __future__ import annotations

from pathlib import Path

from celery import Celery
from sqlalchemy.engine import make_url

from jobs.config import Settings, get_settings

RUN_SHARD = "batchinfer.run_shard"
TICK_SCHEDULES = "batchinfer.tick_schedules"
REAP = "batchinfer.reap"
GRADE_EVAL_SHARD = "batchinfer.grade_eval_shard"
SCHEDULE_TICK_S = 30
SCHEDULES_QUEUE = "schedules"
WORK_QUEUE_PREFIX = "batchinfer.model."
# NOTE: on Redis an unacknowledged message (its worker was killed) comes back after this long; the
# lease and the reaper do not wait for it, and a late duplicate finds nothing to claim.
_VISIBILITY_TIMEOUT_S = 3600

celery_app = Celery("batchinfer", set_as_current=False)


def work_queue(model: str) -> str:
    """The Celery queue of ``RUN_SHARD`` messages for the batches of ``model`` (a configured model's name):
    ``batchinfer.model.<name>``."""
    return WORK_QUEUE_PREFIX + model


def ensure_broker_dir(broker_url: str) -> None:
    """Create the parent directory of an embedded ``sqla+sqlite:///path`` broker file (else no-op)."""
    if not broker_url.startswith("sqla+sqlite:"):
        return
    database = make_url(broker_url.removeprefix("sqla+")).database
    if database and database != ":memory:":
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def configure_celery(settings: Settings | None = None) -> Celery:
    """Point ``celery_app`` at ``settings`` (default `get_settings()`); call before the worker starts.
    The default queue, which a worker consumes, is the `work_queue` of ``settings.served_model_name``."""
    settings = settings or get_settings()
    ensure_broker_dir(settings.broker_url)
    celery_app.conf.update(
        broker_url=settings.broker_url,
        result_backend=settings.result_backend,
        task_ignore_result=settings.result_backend is None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        include=["jobs.tasks"],
        # NOTE: a worker consumes its default queue: the work queue of the model it serves.
        task_default_queue=work_queue(settings.served_model_name),
        task_routes={TICK_SCHEDULES: {"queue": SCHEDULES_QUEUE}, REAP: {"queue": SCHEDULES_QUEUE}},
        beat_schedule={
            TICK_SCHEDULES: {
                "task": TICK_SCHEDULES,
                "schedule": float(SCHEDULE_TICK_S),
                "options": {"expires": float(SCHEDULE_TICK_S)},
            },
            REAP: {
                "task": REAP,
                "schedule": settings.reaper_interval_s,
                "options": {"expires": settings.reaper_interval_s},
            },
        },
        # NOTE: kombu's SQLAlchemy transport passes these options to create_engine(); Redis only.
        broker_transport_options=(
            {"visibility_timeout": _VISIBILITY_TIMEOUT_S} if settings.broker_url.startswith("redis") else {}
        ),
    )
    return celery_app


def enqueue_shards(count: int, *, model: str | None = None, broker_url: str | None = None) -> int:
    """Send ``count`` ``RUN_SHARD`` messages to ``model``'s work queue (default: this process's model,
    ``settings.served_model_name``) on the broker (default ``settings.broker_url``); returns ``count``.

    A fresh connection per call, so the broker named by the current settings is always the one used.

    Raises:
        kombu.exceptions.OperationalError: the broker is unreachable.
    """
    settings = get_settings()
    broker_url = broker_url or settings.broker_url
    queue = work_queue(model or settings.served_model_name)
    ensure_broker_dir(broker_url)
    with celery_app.connection_for_write(broker_url) as connection:
        for _ in range(count):
            celery_app.send_task(RUN_SHARD, connection=connection, queue=queue)
    return count


def enqueue_grading(
    run_id: str, shard_ids: list[str | None], *, model: str | None = None, broker_url: str | None = None
) -> int:
    """Send one ``GRADE_EVAL_SHARD`` message ``(run_id, shard_id)`` per grading unit of an eval run
    (`jobs.evals.dispatch`; ``shard_id`` None: the items that carry their own sample) to ``model``'s work
    queue (default: this process's model), whose workers have the engine model graders ask; returns the count.

    Raises:
        kombu.exceptions.OperationalError: the broker is unreachable.
    """
    settings = get_settings()
    broker_url = broker_url or settings.broker_url
    queue = work_queue(model or settings.served_model_name)
    ensure_broker_dir(broker_url)
    with celery_app.connection_for_write(broker_url) as connection:
        for shard_id in shard_ids:
            celery_app.send_task(GRADE_EVAL_SHARD, args=[run_id, shard_id], connection=connection, queue=queue)
    return len(shard_ids)


def num_waiting_messages(*, broker_url: str | None = None, queue: str | None = None) -> int:
    """Messages waiting in ``queue`` (default: this process's model's `work_queue`; not those a worker
    has taken), as the broker counts them.

    Raises:
        kombu.exceptions.OperationalError: the broker is unreachable.
    """
    settings = get_settings()
    broker_url = broker_url or settings.broker_url
    queue = queue or work_queue(settings.served_model_name)
    ensure_broker_dir(broker_url)
    with celery_app.connection_for_read(broker_url) as connection:
        connection.ensure_connection(max_retries=1)
        with connection.channel() as channel:
            _name, num_messages, _consumers = channel.queue_declare(queue=queue)
    return int(num_messages)


def ping_broker(*, broker_url: str | None = None, timeout_s: float = 2.0) -> None:
    """Connect to the broker once.

    Raises:
        kombu.exceptions.OperationalError: the broker is unreachable within ``timeout_s``.
    """
    broker_url = broker_url or get_settings().broker_url
    ensure_broker_dir(broker_url)
    with celery_app.connection_for_read(broker_url) as connection:
        connection.ensure_connection(max_retries=1, timeout=timeout_s)


configure_celery()
