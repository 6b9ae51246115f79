"""Worker engine format: ``workers.dtype`` and ``quantization`` (null while the worker's engine is loading).

Revision ID: 2026_12_04_worker_engine_format
Revises: 2026_12_02_worker_kv_cache
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_04_worker_engine_format"
down_revision = "2026_12_02_worker_kv_cache"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("dtype", sa.String(16), nullable=True))
        batch.add_column(sa.Column("quantization", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("quantization")
        batch.drop_column("dtype")
