"""The Celery app and task names. The API enqueues by name; the worker defines the tasks.

Broker: ``settings.broker_url`` (Redis in production; the embedded default is kombu's SQLAlchemy
transport over a SQLite file, ``sqla+sqlite:///{data_dir}/broker.db``, whose directory is created
here). Delivery is at-least-once: ``task_acks_late`` + ``task_reject_on_worker_lost`` put a task
back when its worker dies, and ``worker_prefetch_multiplier = 1`` keeps one batch per free worker.
The Redis ``visibility_timeout`` is longer than a batch's 24 h window, so a long-running batch is not
handed to a second worker while the first is still on it.

Beat (``batchinfer beat``: a light worker with an embedded beat, no engine) sends ``TICK_SCHEDULES``
every ``SCHEDULE_TICK_S`` seconds on its own ``SCHEDULES_QUEUE``, so a tick never waits behind a
long batch on an engine worker (those consume only the default queue). The task lives in
`jobs.tasks`; a tick message expires after one interval, so missed ticks are dropped, not replayed.
"""

from __future__ import annotations

from pathlib import Path

from celery import Celery
from sqlalchemy.engine import make_url

from jobs.config import Settings, get_settings
from jobs.schemas import COMPLETION_WINDOW_S

RUN_BATCH = "batchinfer.run_batch"
TICK_SCHEDULES = "batchinfer.tick_schedules"
SCHEDULE_TICK_S = 30
SCHEDULES_QUEUE = "schedules"
_VISIBILITY_TIMEOUT_S = COMPLETION_WINDOW_S + 3600

celery_app = Celery("batchinfer", set_as_current=False)


def ensure_broker_dir(broker_url: str) -> None:
    """Create the parent directory of an embedded ``sqla+sqlite:///path`` broker file (else no-op)."""
    if not broker_url.startswith("sqla+sqlite:"):
        return
    database = make_url(broker_url.removeprefix("sqla+")).database
    if database and database != ":memory:":
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def configure_celery(settings: Settings | None = None) -> Celery:
    """Point ``celery_app`` at ``settings`` (default `get_settings()`); call before the worker starts."""
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
        task_routes={TICK_SCHEDULES: {"queue": SCHEDULES_QUEUE}},
        beat_schedule={
            TICK_SCHEDULES: {
                "task": TICK_SCHEDULES,
                "schedule": float(SCHEDULE_TICK_S),
                "options": {"expires": float(SCHEDULE_TICK_S)},
            }
        },
        # NOTE: kombu's SQLAlchemy transport passes these options to create_engine(); Redis only.
        broker_transport_options=(
            {"visibility_timeout": _VISIBILITY_TIMEOUT_S} if settings.broker_url.startswith("redis") else {}
        ),
    )
    return celery_app


def enqueue_batch(batch_id: str, *, broker_url: str | None = None) -> str:
    """Send ``RUN_BATCH(batch_id)`` to the broker (default ``settings.broker_url``); returns the task id.

    A fresh connection per call, so the broker named by the current settings is always the one used.

    Raises:
        kombu.exceptions.OperationalError: the broker is unreachable.
    """
    broker_url = broker_url or get_settings().broker_url
    ensure_broker_dir(broker_url)
    with celery_app.connection_for_write(broker_url) as connection:
        result = celery_app.send_task(RUN_BATCH, args=[batch_id], connection=connection)
    task_id: str = result.id
    return task_id


configure_celery()
