"""Scheduled runs: cron checks, the beat tick (one batch per due schedule, next_run_at advanced),
and concurrent ticks on PostgreSQL never firing a schedule twice."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session

from jobs.config import Settings
from jobs.db import get_engine, session_scope
from jobs.errors import InvalidRequest
from jobs.files import delete_file, get_file, write_file
from jobs.models import Batch, Schedule
from jobs.queue import RUN_SHARD, SCHEDULE_TICK_S, TICK_SCHEDULES, celery_app
from jobs.repository import get_batch
from jobs.schedules import (
    ScheduledRun,
    create_schedule,
    fire_schedule,
    get_schedule,
    next_run_after,
    run_due_schedules,
)
from jobs.status import BatchStatus, now_s
from tests.helpers.service import (  # noqa: F401
    CHAT,
    COMPLETIONS,
    chat_line,
    configure_service,
    jsonl,
    postgres_url,
    queued_tasks,
    service_settings,
)

T0 = 1_800_000_000  # 2027-01-15 08:00:00 UTC
HOUR_S = 3600


def _clear_schedules(database_url: str) -> None:
    # NOTE: the shared PostgreSQL test database is emptied per test by the service fixture, except this table.
    with session_scope(database_url) as session:
        session.execute(delete(Schedule))


@pytest.fixture
def settings(service_settings: Settings) -> Iterator[Settings]:
    _clear_schedules(service_settings.database_url)
    yield service_settings
    _clear_schedules(service_settings.database_url)


def _input_file_id(session: Session, settings: Settings, num_lines: int = 2) -> str:
    lines = [chat_line(f"q-{idx}") for idx in range(num_lines)]
    file = write_file(session, chunks=[jsonl(lines)], filename="eval.jsonl", purpose="batch")
    return file.id


def _batches_of(session: Session, schedule_id: str) -> list[Batch]:
    batches = session.scalars(select(Batch).order_by(Batch.created_at, Batch.id))
    return [batch for batch in batches if (batch.metadata_ or {}).get("schedule_id") == schedule_id]


@pytest.mark.parametrize(
    ("cron", "after_s", "expected_s"),
    [
        ("0 * * * *", T0, T0 + HOUR_S),
        ("0 * * * *", T0 - 1, T0),
        ("*/5 * * * *", T0 + 1, T0 + 300),
        ("30 8 * * *", T0, T0 + 1800),
        ("0 8 * * *", T0, T0 + 24 * HOUR_S),
        ("  0   *  * * *  ", T0, T0 + HOUR_S),
    ],
)
def test_next_run_after_is_the_next_utc_match(cron: str, after_s: int, expected_s: int) -> None:
    assert next_run_after(cron, after_s) == expected_s


@pytest.mark.parametrize(
    "cron",
    ["", "* * * *", "* * * * * *", "61 * * * *", "* 24 * * *", "every hour", "0 0 31 2 *", "@hourly"],
)
def test_bad_cron_is_refused_naming_the_field(cron: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        next_run_after(cron, T0)
    assert info.value.param == "cron"


def test_create_schedule_checks_what_each_batch_will_need(settings: Settings) -> None:
    with session_scope() as session:
        file_id = _input_file_id(session, settings)
        output = write_file(session, chunks=[b"{}\n"], filename="o.jsonl", purpose="batch_output")
        cases = [
            ({"cron": "0 * * *"}, "cron"),
            ({"input_file_id": "file-nope"}, "input_file_id"),
            ({"input_file_id": output.id}, "input_file_id"),
            ({"endpoint": "/v1/moderations"}, "endpoint"),
            ({"completion_window": "1h"}, "completion_window"),
            # 16 pairs is OpenAI's limit; the batches need one more for schedule_id.
            ({"metadata": {f"k{idx}": "v" for idx in range(16)}}, "metadata"),
        ]
        for overrides, param in cases:
            args = {"cron": "0 * * * *", "input_file_id": file_id, "endpoint": CHAT, **overrides}
            with pytest.raises(InvalidRequest) as info:
                create_schedule(session, **args, now=T0)
            assert info.value.param == param, overrides
        schedule = create_schedule(session, cron="0 * * * *", input_file_id=file_id, endpoint=CHAT, now=T0 - 10)
        assert schedule.id.startswith("sched_")
        assert (schedule.next_run_at, schedule.last_run_at, schedule.last_batch_id) == (T0, None, None)
        assert session.scalar(select(Schedule.id)) == schedule.id


@pytest.mark.parametrize(
    ("content", "endpoint", "code", "line"),
    [
        (jsonl([chat_line("a"), chat_line("b")]), COMPLETIONS, "invalid_url", 1),  # chat lines, completions runs
        (jsonl([chat_line("a"), "{not json", chat_line("c")]), CHAT, "invalid_json", 2),
        (jsonl([chat_line("a"), chat_line("a")]), CHAT, "duplicate_custom_id", 2),
    ],
)
def test_create_schedule_refuses_a_file_every_run_would_fail_on(
    settings: Settings, content: bytes, endpoint: str, code: str, line: int
) -> None:
    with session_scope() as session:
        file_id = write_file(session, chunks=[content], filename="eval.jsonl", purpose="batch").id
        with pytest.raises(InvalidRequest) as info:
            create_schedule(session, cron="0 * * * *", input_file_id=file_id, endpoint=endpoint, now=T0)
        assert (info.value.param, info.value.code) == ("input_file_id", code)
        assert f"line {line}:" in info.value.message
        assert session.scalar(select(Schedule.id)) is None


def test_tick_creates_one_batch_per_due_schedule_and_advances(settings: Settings) -> None:
    with session_scope() as session:
        file_id = _input_file_id(session, settings, num_lines=3)
        hourly = create_schedule(
            session, cron="0 * * * *", input_file_id=file_id, endpoint=CHAT, metadata={"suite": "smoke"}, now=T0 - 10
        ).id
        half_past = create_schedule(session, cron="30 * * * *", input_file_id=file_id, endpoint=CHAT, now=T0 - 10).id
        # Due at T0 - 300 and missed T0 too: the tick coalesces them into one batch.
        five_min = create_schedule(session, cron="*/5 * * * *", input_file_id=file_id, endpoint=CHAT, now=T0 - 600).id

    runs = run_due_schedules(now=T0)

    assert [run.schedule_id for run in runs] == [five_min, hourly]
    assert all(run.batch_id and run.error is None for run in runs)
    with session_scope() as session:
        for run in runs:
            batch = get_batch(session, batch_id=run.batch_id)
            assert batch.status == BatchStatus.IN_PROGRESS
            assert (batch.input_file_id, batch.endpoint, batch.created_at, batch.total_requests) == (
                file_id,
                CHAT,
                T0,
                3,
            )
        assert get_batch(session, batch_id=runs[1].batch_id).metadata_ == {"suite": "smoke", "schedule_id": hourly}
        assert get_batch(session, batch_id=runs[0].batch_id).metadata_ == {"schedule_id": five_min}
        expected = {hourly: (T0 + HOUR_S, T0), half_past: (T0 + 1800, None), five_min: (T0 + 300, T0)}
        for schedule_id, (next_run_at, last_run_at) in expected.items():
            schedule = get_schedule(session, schedule_id=schedule_id)
            assert (schedule.next_run_at, schedule.last_run_at) == (next_run_at, last_run_at)
            assert len(_batches_of(session, schedule_id)) == (0 if last_run_at is None else 1)
        assert get_schedule(session, schedule_id=hourly).last_batch_id == runs[1].batch_id
    assert queued_tasks(settings.broker_url) == [(RUN_SHARD, [])] * len(runs)

    assert run_due_schedules(now=T0) == []
    assert run_due_schedules(now=T0 + 299) == []
    later = run_due_schedules(now=T0 + 1800)
    assert [run.schedule_id for run in later] == [five_min, half_past]
    with session_scope() as session:
        assert [len(_batches_of(session, sid)) for sid in (hourly, half_past, five_min)] == [1, 1, 2]


def test_tick_with_a_deleted_input_file_creates_nothing_but_advances(settings: Settings) -> None:
    with session_scope() as session:
        file_id = _input_file_id(session, settings)
        schedule_id = create_schedule(session, cron="0 * * * *", input_file_id=file_id, endpoint=CHAT, now=T0 - 10).id
        delete_file(session, file=get_file(session, file_id=file_id))

    [run] = run_due_schedules(now=T0)

    assert run.schedule_id == schedule_id and run.batch_id is None
    assert file_id in (run.error or "")
    with session_scope() as session:
        schedule = get_schedule(session, schedule_id=schedule_id)
        assert (schedule.next_run_at, schedule.last_run_at, schedule.last_batch_id) == (T0 + HOUR_S, None, None)
        assert session.scalar(select(Batch.id)) is None


def test_beat_sends_the_tick_and_the_task_runs_without_the_engine(settings: Settings) -> None:
    entry = celery_app.conf.beat_schedule[TICK_SCHEDULES]
    assert (entry["task"], entry["schedule"]) == (TICK_SCHEDULES, SCHEDULE_TICK_S)
    celery_app.loader.import_default_modules()
    task = celery_app.tasks[TICK_SCHEDULES]
    with session_scope() as session:
        file_id = _input_file_id(session, settings)
        schedule_id = create_schedule(
            session, cron="* * * * *", input_file_id=file_id, endpoint=CHAT, now=now_s() - 120
        ).id

    [batch_id] = task.apply().get()

    with session_scope() as session:
        assert get_schedule(session, schedule_id=schedule_id).last_batch_id == batch_id
        assert get_batch(session, batch_id=batch_id).metadata_ == {"schedule_id": schedule_id}
    code = (
        "import sys\nimport jobs.tasks\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker', 'kernels', 'transformers'))\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


@pytest.fixture
def pg_settings(postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    with get_engine(postgres_url).begin() as connection:
        connection.execute(text("TRUNCATE schedules, batch_requests, batch_shards, batches, files"))
    settings = configure_service(monkeypatch, tmp_path / "data", database_url=postgres_url)
    yield settings
    _clear_schedules(postgres_url)


@pytest.mark.postgres
def test_a_tick_skips_a_schedule_another_tick_is_firing(pg_settings: Settings) -> None:
    with session_scope() as session:
        file_id = _input_file_id(session, pg_settings)
        busy, free = (
            create_schedule(session, cron="0 * * * *", input_file_id=file_id, endpoint=CHAT, now=T0 - 10).id
            for _ in range(2)
        )
    runs: list[ScheduledRun] = []
    tick = threading.Thread(target=lambda: runs.extend(run_due_schedules(now=T0)))
    with session_scope() as other_tick:
        assert fire_schedule(other_tick, schedule_id=busy, now=T0) is not None
        # `busy` is locked and its batch not committed yet: this tick must leave it alone, not wait.
        tick.start()
        tick.join(timeout=20)
        finished_while_locked = not tick.is_alive()
    tick.join(timeout=60)
    assert finished_while_locked
    assert [run.schedule_id for run in runs] == [free]
    assert run_due_schedules(now=T0) == []
    with session_scope() as session:
        assert len(_batches_of(session, busy)) == len(_batches_of(session, free)) == 1
        assert get_schedule(session, schedule_id=busy).next_run_at == T0 + HOUR_S


@pytest.mark.postgres
def test_concurrent_ticks_fire_each_due_schedule_exactly_once(pg_settings: Settings) -> None:
    num_schedules, num_ticks = 12, 4
    with session_scope() as session:
        file_id = _input_file_id(session, pg_settings)
        schedule_ids = {
            create_schedule(session, cron="0 * * * *", input_file_id=file_id, endpoint=CHAT, now=T0 - 10).id
            for _ in range(num_schedules)
        }
    barrier = threading.Barrier(num_ticks)
    runs: list[ScheduledRun] = []
    failures: list[BaseException] = []

    def tick() -> None:
        try:
            barrier.wait(timeout=30)
            runs.extend(run_due_schedules(now=T0))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=tick) for _ in range(num_ticks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert failures == []
    assert sorted(run.schedule_id for run in runs) == sorted(schedule_ids)
    with session_scope() as session:
        batches = list(session.scalars(select(Batch)))
        assert sorted(batch.metadata_["schedule_id"] for batch in batches) == sorted(schedule_ids)
        for schedule_id in schedule_ids:
            schedule = get_schedule(session, schedule_id=schedule_id)
            assert schedule.next_run_at == T0 + HOUR_S
            assert schedule.last_batch_id in {batch.id for batch in batches}
