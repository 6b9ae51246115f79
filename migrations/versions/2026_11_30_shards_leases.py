"""Shards and leases: the ``batch_shards`` table and each line's ``shard_id`` (docs/operations.md).

A batch still running when this migration is applied gets one shard holding all of its lines, queued,
so the reaper hands it to a worker like any other.

Revision ID: 2026_11_30_shards_leases
Revises: 2026_11_30_api_keys
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_30_shards_leases"
down_revision = "2026_11_30_api_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batch_shards",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE"), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("num_requests", sa.Integer(), nullable=False),
        sa.Column("num_tokens", sa.BigInteger(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_token", sa.String(64), nullable=True),
        sa.Column("lease_owner", sa.String(320), nullable=True),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.UniqueConstraint("batch_id", "shard_index", name="uq_batch_shards_batch_id_shard_index"),
    )
    op.create_index("ix_batch_shards_state_lease_expires_at", "batch_shards", ["state", "lease_expires_at"])
    op.create_index("ix_batch_shards_batch_id_state", "batch_shards", ["batch_id", "state"])
    op.add_column("batch_requests", sa.Column("shard_id", sa.String(64), nullable=True))
    op.create_index("ix_batch_requests_shard_id_state", "batch_requests", ["shard_id", "state"])
    # NOTE: batches mid-run get one queued shard each ("shard_" + the batch id's hex part); `||` is
    # string concatenation on both PostgreSQL and SQLite.
    op.execute(
        """
        INSERT INTO batch_shards (id, batch_id, shard_index, num_requests, num_tokens, priority, state, attempts,
                                  created_at)
        SELECT 'shard_' || substr(b.id, 7), b.id, 0, b.total_requests, 0, 0, 'queued', 0, b.created_at
        FROM batches b
        WHERE b.status IN ('in_progress', 'cancelling') AND b.total_requests > 0
        """
    )
    op.execute(
        """
        UPDATE batch_requests SET shard_id = 'shard_' || substr(batch_id, 7)
        WHERE batch_id IN (SELECT batch_id FROM batch_shards)
        """
    )


def downgrade() -> None:
    op.drop_index("ix_batch_requests_shard_id_state", table_name="batch_requests")
    op.drop_column("batch_requests", "shard_id")
    op.drop_index("ix_batch_shards_batch_id_state", table_name="batch_shards")
    op.drop_index("ix_batch_shards_state_lease_expires_at", table_name="batch_shards")
    op.drop_table("batch_shards")
