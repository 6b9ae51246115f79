"""Line checkpoints: a pending line's generated token ids, so an interrupted run resumes from them (#25).

``batch_requests.checkpoint_token_ids`` holds the output token ids a worker generated so far for a line
still running (None: none saved; cleared when the line's result is recorded); ``recomputed_tokens``
counts the line's generated tokens thrown away by interrupted runs after their last checkpoint (they
were generated again). See docs/operations.md, "Checkpoints".

Revision ID: 2026_12_02_line_checkpoints
Revises: 2026_11_30_shards_leases
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_02_line_checkpoints"
down_revision = "2026_11_30_shards_leases"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batch_requests", sa.Column("checkpoint_token_ids", sa.JSON(), nullable=True))
    op.add_column(
        "batch_requests", sa.Column("recomputed_tokens", sa.Integer(), nullable=False, server_default=sa.text("0"))
    )


def downgrade() -> None:
    with op.batch_alter_table("batch_requests") as batch_op:
        batch_op.drop_column("recomputed_tokens")
        batch_op.drop_column("checkpoint_token_ids")
