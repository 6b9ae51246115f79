"""API keys and ownership (``api_keys``, ``owner_key_id`` on files, batches and schedules), and
``file_chunks`` for file bytes kept in the database (docs/api.md, "API keys"; jobs/storage.py).

Revision ID: 2026_11_30_api_keys
Revises: 2026_11_30_workers
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_30_api_keys"
down_revision = "2026_11_30_workers"
branch_labels = None
depends_on = None

_OWNED = ("files", "batches", "schedules")


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("key_prefix", sa.String(32), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("revoked_at", sa.BigInteger(), nullable=True),
    )
    for table in _OWNED:
        op.add_column(table, sa.Column("owner_key_id", sa.String(64), nullable=True))
        op.create_index(f"ix_{table}_owner_key_id_created_at", table, ["owner_key_id", "created_at"])
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(512), primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True),
        sa.Column("data", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("file_chunks")
    for table in _OWNED:
        op.drop_index(f"ix_{table}_owner_key_id_created_at", table_name=table)
        with op.batch_alter_table(table) as batch:
            batch.drop_column("owner_key_id")
    op.drop_table("api_keys")
