"""The Celery app's delivery settings, and `enqueue_batch` on the embedded broker and on Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.config import Settings
from jobs.queue import RUN_BATCH, celery_app, configure_celery, enqueue_batch
from tests.helpers.service import queued_tasks, redis_broker_url, sqlite_settings  # noqa: F401


def test_delivery_settings(sqlite_settings: Settings) -> None:
    conf = configure_celery(sqlite_settings).conf
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_url == sqlite_settings.broker_url


def test_enqueue_on_embedded_broker_creates_its_directory(sqlite_settings: Settings, tmp_path: Path) -> None:
    broker_url = f"sqla+sqlite:///{tmp_path / 'not' / 'yet' / 'broker.db'}"
    enqueue_batch("batch_a", broker_url=broker_url)
    enqueue_batch("batch_b", broker_url=broker_url)
    assert (tmp_path / "not" / "yet" / "broker.db").exists()
    assert queued_tasks(broker_url) == [(RUN_BATCH, ["batch_a"]), (RUN_BATCH, ["batch_b"])]
    assert queued_tasks(broker_url) == []


def test_enqueue_uses_settings_broker_by_default(sqlite_settings: Settings) -> None:
    task_id = enqueue_batch("batch_c")
    assert task_id
    assert queued_tasks(sqlite_settings.broker_url) == [(RUN_BATCH, ["batch_c"])]


@pytest.mark.redis
def test_enqueue_on_redis(redis_broker_url: str) -> None:
    enqueue_batch("batch_r", broker_url=redis_broker_url)
    assert queued_tasks(redis_broker_url) == [(RUN_BATCH, ["batch_r"])]
    assert celery_app.conf.task_acks_late is True
