"""Worker heartbeats: the ``workers`` table (``GET /v1/workers``, the jobs page).

Revision ID: 2026_11_30_workers
Revises: 2026_11_29_schedules
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_30_workers"
down_revision = "2026_11_29_schedules"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(320), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("device", sa.String(32), nullable=False),
        sa.Column("current_batch_id", sa.String(64), nullable=True),
        sa.Column("num_running_requests", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("metrics_port", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("last_heartbeat_at", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_workers_last_heartbeat_at", "workers", ["last_heartbeat_at"])


def downgrade() -> None:
    op.drop_index("ix_workers_last_heartbeat_at", table_name="workers")
    op.drop_table("workers")
