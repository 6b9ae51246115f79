"""Evaluation runs: ``evals``, ``eval_runs`` and ``eval_output_items`` (OpenAI's Evals API, `jobs.evals`).

Revision ID: 2026_12_02_evals
Revises: 2026_12_02_worker_ready
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_12_02_evals"
down_revision = "2026_12_02_worker_ready"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "evals",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(512), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("data_source_config", sa.JSON(), nullable=False),
        sa.Column("testing_criteria", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("owner_key_id", sa.String(64), nullable=True),
    )
    op.create_index("ix_evals_created_at_id", "evals", ["created_at", "id"])
    op.create_index("ix_evals_owner_key_id_created_at", "evals", ["owner_key_id", "created_at"])
    op.create_table(
        "eval_runs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("eval_id", sa.String(64), sa.ForeignKey("evals.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(512), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("data_source", sa.JSON(), nullable=False),
        sa.Column("batch_id", sa.String(64), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("num_total", sa.Integer(), nullable=False),
        sa.Column("num_passed", sa.Integer(), nullable=False),
        sa.Column("num_failed", sa.Integer(), nullable=False),
        sa.Column("num_errored", sa.Integer(), nullable=False),
        sa.Column("per_testing_criteria_results", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("completed_at", sa.BigInteger(), nullable=True),
        sa.Column("owner_key_id", sa.String(64), nullable=True),
    )
    op.create_index("ix_eval_runs_eval_id_created_at", "eval_runs", ["eval_id", "created_at"])
    op.create_index("ix_eval_runs_batch_id", "eval_runs", ["batch_id"])
    op.create_index("ix_eval_runs_status", "eval_runs", ["status"])
    op.create_table(
        "eval_output_items",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.String(64), sa.ForeignKey("eval_runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("eval_id", sa.String(64), nullable=False),
        sa.Column("datasource_item_id", sa.Integer(), nullable=False),
        sa.Column("datasource_item", sa.JSON(), nullable=False),
        sa.Column("given_sample", sa.JSON(), nullable=True),
        sa.Column("custom_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("results", sa.JSON(), nullable=True),
        sa.Column("sample", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("run_id", "datasource_item_id", name="uq_eval_output_items_run_id_item_id"),
    )
    op.create_index("ix_eval_output_items_run_id_status", "eval_output_items", ["run_id", "status"])
    op.create_index("ix_eval_output_items_run_id_custom_id", "eval_output_items", ["run_id", "custom_id"])


def downgrade() -> None:
    op.drop_table("eval_output_items")
    op.drop_table("eval_runs")
    op.drop_table("evals")
