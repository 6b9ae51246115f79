"""Text the service cannot store, and capped error lists (docs/api.md, "Text the service stores").

- ``batch_requests.custom_id`` may be null: a line whose ``custom_id`` PostgreSQL cannot hold (a NUL
  character, a lone surrogate) keeps it in the new JSON column ``custom_id_sent`` (JSON escapes it)
  and is answered with its own 400;
- ``batches.num_errors``: how many input-file errors were found; ``errors`` keeps the first 1,000
  (null on batches validated before this migration: ``errors`` holds them all).

Revision ID: 2026_12_02_storable_text
Revises: 2026_12_02_line_checkpoints
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_02_storable_text"
down_revision = "2026_12_02_line_checkpoints"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batch_requests") as batch_op:
        batch_op.alter_column("custom_id", existing_type=sa.String(512), nullable=True)
        batch_op.add_column(sa.Column("custom_id_sent", sa.JSON(), nullable=True))
    op.add_column("batches", sa.Column("num_errors", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "num_errors")
    op.execute("DELETE FROM batch_requests WHERE custom_id IS NULL")
    with op.batch_alter_table("batch_requests") as batch_op:
        batch_op.drop_column("custom_id_sent")
        batch_op.alter_column("custom_id", existing_type=sa.String(512), nullable=False)
