"""The Celery app's delivery settings, and work messages on the embedded broker and on Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
from kombu.exceptions import OperationalError

from jobs.config import Settings
from jobs.queue import (
    REAP,
    RUN_SHARD,
    SCHEDULES_QUEUE,
    celery_app,
    configure_celery,
    enqueue_shards,
    num_waiting_messages,
    ping_broker,
)
from tests.helpers.service import queued_tasks, redis_broker_url, sqlite_settings  # noqa: F401


def test_delivery_settings(sqlite_settings: Settings) -> None:
    conf = configure_celery(sqlite_settings).conf
    assert conf.task_acks_late is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_url == sqlite_settings.broker_url
    reap = conf.beat_schedule[REAP]
    assert reap["schedule"] == sqlite_settings.reaper_interval_s
    assert conf.task_routes[REAP] == {"queue": SCHEDULES_QUEUE}


def test_enqueue_on_embedded_broker_creates_its_directory(sqlite_settings: Settings, tmp_path: Path) -> None:
    broker_url = f"sqla+sqlite:///{tmp_path / 'not' / 'yet' / 'broker.db'}"
    assert enqueue_shards(2, broker_url=broker_url) == 2
    assert (tmp_path / "not" / "yet" / "broker.db").exists()
    assert num_waiting_messages(broker_url=broker_url) == 2
    assert queued_tasks(broker_url) == [(RUN_SHARD, []), (RUN_SHARD, [])]
    assert queued_tasks(broker_url) == []
    assert num_waiting_messages(broker_url=broker_url) == 0


def test_enqueue_uses_settings_broker_by_default(sqlite_settings: Settings) -> None:
    enqueue_shards(1)
    assert queued_tasks(sqlite_settings.broker_url) == [(RUN_SHARD, [])]


@pytest.mark.redis
def test_enqueue_and_count_on_redis(redis_broker_url: str) -> None:
    assert num_waiting_messages(broker_url=redis_broker_url) == 0  # a queue never declared counts as empty
    enqueue_shards(3, broker_url=redis_broker_url)
    assert num_waiting_messages(broker_url=redis_broker_url) == 3
    ping_broker(broker_url=redis_broker_url)
    assert queued_tasks(redis_broker_url) == [(RUN_SHARD, [])] * 3


def test_unreachable_broker_raises(sqlite_settings: Settings) -> None:
    with pytest.raises(OperationalError):
        ping_broker(broker_url="redis://127.0.0.1:1/0", timeout_s=1)
    with pytest.raises(OperationalError):
        enqueue_shards(1, broker_url="redis://127.0.0.1:1/0")
    assert celery_app.conf.task_acks_late is True
