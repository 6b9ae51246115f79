"""Worker readiness: ``workers.ready_s`` (seconds from the worker's start until it took work; null while starting).

Revision ID: 2026_12_02_worker_ready
Revises: 2026_12_02_storable_text
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_02_worker_ready"
down_revision = "2026_12_02_storable_text"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("ready_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("ready_s")
