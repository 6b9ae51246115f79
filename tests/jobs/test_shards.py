"""Shards under leases and the reaper, on SQLite and PostgreSQL (docs/operations.md): fair claims,
lease renewal and loss, hand-back, lapsed leases re-queued then failed, batches settled, the
completion window enforced without a worker, and the work queue topped up."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select

from jobs.config import Settings
from jobs.db import session_scope
from jobs.files import file_chunks, get_file, write_file
from jobs.models import BatchShard
from jobs.queue import RUN_SHARD, work_queue
from jobs.reaper import reap
from jobs.repository import apply_validation, cancel_batch, create_batch, get_batch, pending_requests, record_result
from jobs.shards import (
    SHARD_FAILED,
    claim_next_shard,
    finish_shard,
    hand_back_shard,
    holds_lease,
    renew_lease,
    settle_batch,
)
from jobs.status import now_s
from jobs.storage import storage_from_settings
from jobs.validation import ValidatedLine
from jobs.workers import record_heartbeat
from tests.helpers.service import COMPLETIONS, completion_line, jsonl, postgres_url, queued_tasks, service_settings  # noqa: F401

LEASE_S = 60.0


def _batch(
    settings: Settings,
    num_lines: int,
    *,
    metadata: dict[str, str] | None = None,
    now: int | None = None,
    model: str = "m",
) -> str:
    """An in-progress batch of ``num_lines`` completion lines, one shard per line (a tiny token target)."""
    now = now_s() if now is None else now
    lines = [completion_line(f"line-{i}", f"prompt {i}", max_tokens=1) for i in range(num_lines)]
    settings.shard_target_tokens = 1
    with session_scope() as session:
        file = write_file(
            session,
            chunks=[jsonl(lines)],
            filename="in.jsonl",
            purpose="batch",
            storage=storage_from_settings(settings),
        )
        batch = create_batch(session, input_file_id=file.id, endpoint=COMPLETIONS, metadata=metadata, now=now)
        validated = [ValidatedLine(i + 1, line["custom_id"], line["body"]) for i, line in enumerate(lines)]
        apply_validation(session, batch_id=batch.id, lines=validated, errors=[], model=model, now=now)
        return batch.id


def _claim(owner: str = "w:1", now: float | None = None, model: str | None = None):
    with session_scope() as session:
        return claim_next_shard(session, owner=owner, now=now_s() if now is None else now, lease_s=LEASE_S, model=model)


def _record_all(lease) -> None:
    with session_scope() as session:
        for row in pending_requests(session, batch_id=lease.batch_id, shard_id=lease.shard_id):
            record_result(
                session, request_id=row.id, response={"status_code": 200, "request_id": "r", "body": {}}, error=None
            )


def _files(settings: Settings, batch_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with session_scope() as session:
        batch = get_batch(session, batch_id=batch_id)
        result = []
        for file_id in (batch.output_file_id, batch.error_file_id):
            file = None if file_id is None else get_file(session, file_id=file_id)
            storage = storage_from_settings(settings)
            text = "" if file is None else b"".join(file_chunks(file, storage=storage, session=session)).decode()
            result.append([json.loads(line) for line in text.splitlines()])
        return result[0], result[1]


def test_claims_share_workers_fairly_between_batches_and_honour_priority(service_settings: Settings) -> None:
    now = now_s()
    first = _batch(service_settings, 4, now=now - 10)
    second = _batch(service_settings, 4, now=now - 5)
    claims = [_claim(f"w:{i}") for i in range(4)]
    # the older batch first, then the one with fewer shards running: turns alternate
    assert [lease.batch_id for lease in claims] == [first, second, first, second]
    urgent = _batch(service_settings, 2, metadata={"priority": "5"}, now=now)
    assert _claim("w:9").batch_id == urgent


def test_no_claim_on_a_cancelled_or_expired_batch(service_settings: Settings) -> None:
    now = now_s()
    expired = _batch(service_settings, 1, now=now - 2 * 86400)
    cancelled = _batch(service_settings, 1, now=now)
    with session_scope() as session:
        cancel_batch(session, batch_id=cancelled)
    assert _claim() is None
    with session_scope() as session:
        assert get_batch(session, batch_id=expired).status == "in_progress"


def test_renew_hand_back_and_a_lost_lease(service_settings: Settings) -> None:
    _batch(service_settings, 1)
    lease = _claim()
    with session_scope() as session:
        assert renew_lease(session, lease=lease, now=now_s(), lease_s=LEASE_S) and holds_lease(session, lease=lease)
        assert hand_back_shard(session, lease=lease)
        shard = session.get(BatchShard, lease.shard_id)
        assert (shard.state, shard.attempts, shard.lease_token) == ("queued", 0, None)  # a hand-back is no attempt
        assert not renew_lease(session, lease=lease, now=now_s(), lease_s=LEASE_S)
        assert not holds_lease(session, lease=lease) and not finish_shard(session, lease=lease, now=now_s())
    again = _claim("w:2")
    assert again.shard_id == lease.shard_id and again.token != lease.token


def test_a_lapsed_lease_is_requeued_then_failed_and_the_batch_still_ends(service_settings: Settings) -> None:
    service_settings.shard_max_attempts = 2
    batch_id = _batch(service_settings, 2)
    now = now_s()
    done = _claim("w:1", now)
    _record_all(done)
    with session_scope() as session:
        assert finish_shard(session, lease=done, now=now)
    for attempt in (1, 2):
        lease = _claim(f"w:{attempt}", now)
        assert lease is not None and lease.shard_id != done.shard_id
        assert reap(settings=service_settings, now=now + LEASE_S - 1).requeued_shards == []  # not lapsed yet
        report = reap(settings=service_settings, now=now + LEASE_S + 1)
        assert (report.requeued_shards, report.failed_shards) == (
            ([lease.shard_id], []) if attempt == 1 else ([], [lease.shard_id])
        )
    assert report.finalized == {batch_id: "completed"}
    output, errors = _files(service_settings, batch_id)
    assert len(output) == 1 and [e["error"]["code"] for e in errors] == [SHARD_FAILED]
    with session_scope() as session:
        batch = get_batch(session, batch_id=batch_id)
        assert (batch.completed_requests, batch.failed_requests) == (1, 1)


def _heartbeat(worker_id: str, at: float) -> None:
    host, pid = worker_id.split(":")
    with session_scope() as session:
        record_heartbeat(
            session,
            worker_id=worker_id,
            host=host,
            pid=int(pid),
            model="m",
            device="cpu",
            current_batch_id=None,
            num_running_requests=0,
            tokens_per_s=0.0,
            metrics_port=None,
            started_at=int(at),
            now=int(at),
            ready_s=1.0,
        )


def test_a_killed_workers_shard_is_taken_back_when_its_heartbeat_stops_not_when_its_lease_lapses(
    service_settings: Settings,
) -> None:
    """The reaper's clock (``now``) moves in heartbeat steps: worker h:1 is killed at once, h:2 lives on
    (heartbeat and lease renewals), h:3 holds a lease but never wrote a heartbeat row."""
    _batch(service_settings, 3)
    start = now_s()
    killed, live, rowless = _claim("h:1", start), _claim("h:2", start), _claim("h:3", start)
    _heartbeat("h:1", start)
    dead_s, beat_s = service_settings.worker_dead_s, service_settings.worker_heartbeat_s
    assert dead_s + beat_s < LEASE_S  # the heartbeat rule must come first for this test to mean anything
    taken_back_at = None
    now = float(start)
    while now < start + 3 * LEASE_S:
        _heartbeat("h:2", now)
        with session_scope() as session:
            assert renew_lease(session, lease=live, now=now, lease_s=LEASE_S)
        report = reap(settings=service_settings, now=now)
        assert live.shard_id not in report.requeued_shards + report.failed_shards  # a live worker: never
        if killed.shard_id in report.requeued_shards:
            assert taken_back_at is None
            taken_back_at = now
            assert report.messages_sent == 1  # its message goes out in the same pass
        if rowless.shard_id in report.requeued_shards:
            assert now > start + LEASE_S  # no heartbeat row: only its lease's expiry counts
        now += beat_s
    assert taken_back_at is not None and start + dead_s < taken_back_at <= start + dead_s + beat_s
    with session_scope() as session:
        assert holds_lease(session, lease=live) and not holds_lease(session, lease=killed)
        assert not renew_lease(session, lease=killed, now=now, lease_s=LEASE_S)  # were it alive, it would stop
        shard = session.get(BatchShard, killed.shard_id)
        assert (shard.state, shard.attempts, shard.lease_owner) == ("queued", 1, None)
    assert _claim("h:2", now).shard_id in {killed.shard_id, rowless.shard_id}


def test_a_late_heartbeat_asks_for_a_pass_when_its_shard_will_lapse(service_settings: Settings, monkeypatch) -> None:
    """A pass that sees a holder's heartbeat late reports when its shard lapses, if sooner than the next
    scheduled pass; the task sends that pass (so a killed worker's shard does not wait out the interval)."""
    import jobs.tasks

    _batch(service_settings, 1)
    start = now_s()
    lease = _claim("h:1", start)
    _heartbeat("h:1", start)
    dead_s, interval_s = service_settings.worker_dead_s, service_settings.reaper_interval_s
    assert reap(settings=service_settings, now=start + 1).next_pass_in_s is None  # fresh: the schedule will do
    late = reap(settings=service_settings, now=start + dead_s - 3)
    assert late.requeued_shards == [] and late.next_pass_in_s == 3.5
    assert reap(settings=service_settings, now=start + dead_s + 0.5).requeued_shards == [lease.shard_id]
    assert reap(settings=service_settings, now=start + dead_s + 1).next_pass_in_s is None  # nothing runs
    assert interval_s > 3.5

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(jobs.tasks.reap_stranded_work, "apply_async", lambda **kwargs: sent.append(kwargs))
    lease = _claim("h:1", now_s())
    _heartbeat("h:1", now_s() - dead_s + 2)
    assert jobs.tasks.reap_stranded_work.run()["next_pass_in_s"] is not None
    (kwargs,) = sent
    assert 0 < kwargs["countdown"] <= 3.5


def test_cancel_with_a_dead_worker_ends_cancelled_once_the_lease_lapses(service_settings: Settings) -> None:
    batch_id = _batch(service_settings, 3)
    now = now_s()
    lease = _claim("w:dead", now)
    _record_all(lease)
    with session_scope() as session:
        assert cancel_batch(session, batch_id=batch_id, now=now).status == "cancelling"  # the lease still looks live
        assert settle_batch(session, batch_id=batch_id, now=now) == "cancelling"
    assert reap(settings=service_settings, now=now + LEASE_S + 1).finalized == {batch_id: "cancelled"}
    output, errors = _files(service_settings, batch_id)
    assert len(output) == 1 and {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(errors) == 2
    with session_scope() as session:
        states = set(session.scalars(select(BatchShard.state).where(BatchShard.batch_id == batch_id)))
    assert states == {"finished"}


def test_the_reaper_expires_a_batch_no_worker_took(service_settings: Settings) -> None:
    service_settings.completion_window = "30s"
    now = now_s()
    batch_id = _batch(service_settings, 3, now=now)
    with session_scope() as session:
        batch = get_batch(session, batch_id=batch_id)
        assert (batch.completion_window, batch.expires_at) == ("30s", now + 30)
    assert reap(settings=service_settings, now=now + 29).finalized == {}
    assert reap(settings=service_settings, now=now + 30).finalized == {batch_id: "expired"}
    output, errors = _files(service_settings, batch_id)
    assert output == [] and len(errors) == 3
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert "completion window 30s" in errors[0]["error"]["message"]


def test_the_reaper_tops_the_queue_up_to_one_message_per_queued_shard(service_settings: Settings) -> None:
    _batch(service_settings, 3)  # validated directly: no message was ever sent
    assert queued_tasks(service_settings.broker_url) == []
    assert reap(settings=service_settings).messages_sent == 3
    assert reap(settings=service_settings).messages_sent == 0  # three are waiting already
    assert queued_tasks(service_settings.broker_url, work_queue("m")) == [(RUN_SHARD, [])] * 3
    _claim()
    assert reap(settings=service_settings).messages_sent == 2


def test_a_batch_is_claimed_only_by_a_worker_of_its_model(service_settings: Settings) -> None:
    chat_id = _batch(service_settings, 2, model="chat")
    mini_id = _batch(service_settings, 1, model="mini")
    assert _claim("w:embed", model="embedder") is None
    first, second = _claim("w:mini", model="mini"), _claim("w:mini", model="mini")
    assert first is not None and first.batch_id == mini_id and second is None
    assert {_claim("w:chat", model="chat").batch_id for _ in range(2)} == {chat_id}
    assert _claim("w:chat", model="chat") is None


def test_the_reaper_tops_up_each_models_queue_with_that_models_shards(service_settings: Settings) -> None:
    _batch(service_settings, 2, model="chat")
    _batch(service_settings, 1, model="mini")
    assert reap(settings=service_settings).messages_sent == 3
    broker_url = service_settings.broker_url
    assert queued_tasks(broker_url, work_queue("chat")) == [(RUN_SHARD, [])] * 2
    assert queued_tasks(broker_url, work_queue("mini")) == [(RUN_SHARD, [])]


def test_the_reaper_survives_an_unreachable_broker(service_settings: Settings) -> None:
    _batch(service_settings, 1)
    down = service_settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    assert reap(settings=down).messages_sent == 0
