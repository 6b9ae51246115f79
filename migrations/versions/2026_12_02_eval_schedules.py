"""Scheduled eval runs: ``schedules.eval_id``, ``run_spec`` and ``last_run_id``; a schedule of an eval has
no input file or endpoint of its own.

Revision ID: 2026_12_02_eval_schedules
Revises: 2026_12_02_evals
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_02_eval_schedules"
down_revision = "2026_12_02_evals"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("schedules") as batch:
        batch.alter_column("input_file_id", existing_type=sa.String(64), nullable=True)
        batch.alter_column("endpoint", existing_type=sa.String(64), nullable=True)
        batch.add_column(sa.Column("eval_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("run_spec", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("last_run_id", sa.String(64), nullable=True))


def downgrade() -> None:
    op.execute("DELETE FROM schedules WHERE eval_id IS NOT NULL")
    with op.batch_alter_table("schedules") as batch:
        batch.drop_column("last_run_id")
        batch.drop_column("run_spec")
        batch.drop_column("eval_id")
        batch.alter_column("endpoint", existing_type=sa.String(64), nullable=False)
        batch.alter_column("input_file_id", existing_type=sa.String(64), nullable=False)
