"""Worker KV cache size: ``workers.kv_cache_dtype``, ``num_kv_blocks`` and ``kv_cache_bytes`` (null while the
worker's engine is loading).

Revision ID: 2026_12_02_worker_kv_cache
Revises: 2026_12_02_eval_schedules
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_02_worker_kv_cache"
down_revision = "2026_12_02_eval_schedules"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("kv_cache_dtype", sa.String(16), nullable=True))
        batch.add_column(sa.Column("num_kv_blocks", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("kv_cache_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("kv_cache_bytes")
        batch.drop_column("num_kv_blocks")
        batch.drop_column("kv_cache_dtype")
