"""Line checkpoints on SQLite and PostgreSQL (docs/operations.md, "Checkpoints"): written only under the
shard's live lease, never onto a recorded line or another shard's line, read back by the next claim,
cleared when the line's result is recorded."""

from __future__ import annotations

from sqlalchemy import update

from jobs.checkpoints import save_checkpoints
from jobs.db import session_scope
from jobs.models import BatchRequest, BatchShard
from jobs.repository import pending_requests, record_result
from jobs.shards import hand_back_shard
from tests.helpers.service import postgres_url, service_settings  # noqa: F401
from tests.jobs.test_shards import _batch, _claim


def _line(request_id: str) -> tuple[list[int] | None, int]:
    with session_scope() as session:
        row = session.get(BatchRequest, request_id)
        assert row is not None
        return row.checkpoint_token_ids, row.recomputed_tokens


def test_checkpoints_are_written_under_the_lease_and_read_back_by_the_next_claim(service_settings):
    batch_id = _batch(service_settings, 2)
    lease, other = _claim(), _claim(owner="w:2")
    with session_scope() as session:
        (line,) = pending_requests(session, batch_id=batch_id, shard_id=lease.shard_id)
        (other_line,) = pending_requests(session, batch_id=batch_id, shard_id=other.shard_id)

    with session_scope() as session:
        written = save_checkpoints(
            session,
            lease=lease,
            token_ids={line.id: [5, 6, 7], other_line.id: [9]},
            recomputed_tokens={line.id: 3},
        )
    assert written
    assert _line(line.id) == ([5, 6, 7], 3) and _line(other_line.id) == (None, 0)  # not this lease's shard

    with session_scope() as session:
        assert save_checkpoints(session, lease=lease, token_ids={line.id: [5, 6, 7, 8]}, recomputed_tokens={line.id: 2})
        hand_back_shard(session, lease=lease)
    assert _line(line.id) == ([5, 6, 7, 8], 5)
    again = _claim(owner="w:3")
    assert again.shard_id == lease.shard_id
    with session_scope() as session:
        (resumed,) = pending_requests(session, batch_id=batch_id, shard_id=again.shard_id)
        assert resumed.checkpoint_token_ids == [5, 6, 7, 8]

        record_result(
            session, request_id=line.id, response={"status_code": 200, "request_id": "r", "body": {}}, error=None
        )
    assert _line(line.id) == (None, 5)
    with session_scope() as session:
        assert save_checkpoints(session, lease=again, token_ids={line.id: [1]})
    assert _line(line.id) == (None, 5)  # a recorded line keeps no checkpoint


def test_a_lease_no_longer_held_writes_nothing(service_settings):
    batch_id = _batch(service_settings, 1)
    lease = _claim()
    with session_scope() as session:
        (line,) = pending_requests(session, batch_id=batch_id, shard_id=lease.shard_id)
        session.execute(update(BatchShard).where(BatchShard.id == lease.shard_id).values(lease_token="someone-else"))

    with session_scope() as session:
        assert not save_checkpoints(session, lease=lease, token_ids={line.id: [5]}, recomputed_tokens={line.id: 1})
    assert _line(line.id) == (None, 0)
