"""Scheduled evaluation runs: the ``schedules`` table.

Revision ID: 2026_11_29_schedules
Revises: 2026_11_29_initial
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_29_schedules"
down_revision = "2026_11_29_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("cron", sa.String(128), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("next_run_at", sa.BigInteger(), nullable=False),
        sa.Column("last_run_at", sa.BigInteger(), nullable=True),
        sa.Column("last_batch_id", sa.String(64), nullable=True),
    )
    op.create_index("ix_schedules_created_at_id", "schedules", ["created_at", "id"])
    op.create_index("ix_schedules_next_run_at", "schedules", ["next_run_at"])


def downgrade() -> None:
    op.drop_index("ix_schedules_next_run_at", table_name="schedules")
    op.drop_index("ix_schedules_created_at_id", table_name="schedules")
    op.drop_table("schedules")
