"""The Batch API: tenants' files, batches and their per-line checkpoints; batch usage in the ledger.

- batch_files, batches, batch_lines (services/common/models/batches.py).
- usage_events.service_tier: 'default' | 'batch' (a batch line's ledger row).
- prices.batch_discount_bps: the price book's batch rate per model and plan (default: half price).
- tenant_limits.monthly_batch_token_budget: the batch quota, apart from the live windows.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def _batch_files() -> None:
    op.create_table(
        "batch_files",
        sa.Column("id", sa.Uuid(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("purpose", sa.Text(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.Text(), nullable=False),
        sa.Column("storage_uri", sa.Text(), nullable=False),
        sa.Column("created_at", _TS, server_default=sa.text("now()"), nullable=False),
        sa.Column("deleted_at", _TS, nullable=True),
        sa.CheckConstraint("purpose IN ('batch', 'batch_output')", name=op.f("ck_batch_files_purpose_known")),
        sa.CheckConstraint("bytes >= 0 AND line_count >= 0", name=op.f("ck_batch_files_sizes_nonneg")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_batch_files_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_files")),
        sa.UniqueConstraint("id", "tenant_id", name=op.f("uq_batch_files_id_tenant_id")),
    )
    op.create_index("ix_batch_files_tenant_id_created_at", "batch_files", ["tenant_id", "created_at"])


def _batches() -> None:
    file_fk = ["batch_files.id", "batch_files.tenant_id"]
    op.create_table(
        "batches",
        sa.Column("id", sa.Uuid(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("api_key_id", sa.Uuid(), nullable=True),
        sa.Column("input_file_id", sa.Uuid(), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("completion_window", sa.Text(), nullable=False),
        sa.Column("status", sa.Enum("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                                    "cancelling", "cancelled", name="batch_status", native_enum=False,
                                    create_constraint=True, length=32), nullable=False),
        sa.Column("metadata", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("errors", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("output_file_id", sa.Uuid(), nullable=True),
        sa.Column("error_file_id", sa.Uuid(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("failed", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", _TS, server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", _TS, nullable=False),
        *(sa.Column(c, _TS, nullable=True) for c in ("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                                                     "expired_at", "cancelling_at", "cancelled_at")),
        sa.CheckConstraint("completed >= 0 AND failed >= 0 AND completed + failed <= total",
                           name=op.f("ck_batches_counts_add_up")),
        sa.ForeignKeyConstraint(["input_file_id", "tenant_id"], file_fk,
                                name=op.f("fk_batches_input_file_id_tenant_id_batch_files")),
        sa.ForeignKeyConstraint(["output_file_id", "tenant_id"], file_fk,
                                name=op.f("fk_batches_output_file_id_tenant_id_batch_files")),
        sa.ForeignKeyConstraint(["error_file_id", "tenant_id"], file_fk,
                                name=op.f("fk_batches_error_file_id_tenant_id_batch_files")),
        sa.ForeignKeyConstraint(["api_key_id", "tenant_id"], ["api_keys.id", "api_keys.tenant_id"],
                                name=op.f("fk_batches_api_key_id_tenant_id_api_keys")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_batches_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
        sa.UniqueConstraint("id", "tenant_id", name=op.f("uq_batches_id_tenant_id")),
    )
    op.create_index("ix_batches_tenant_id_id", "batches", ["tenant_id", "id"])
    op.create_index("ix_batches_status", "batches", ["status"])


def _batch_lines() -> None:
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.Uuid(), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("state", sa.Enum("pending", "done", "failed", "skipped", name="batch_line_state", native_enum=False,
                                   create_constraint=True, length=32), nullable=False),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("answered_at", _TS, nullable=True),
        sa.CheckConstraint("(state = 'pending') = (result IS NULL)", name=op.f("ck_batch_lines_answered_has_result")),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_batch_lines_batch_id_batches")),
        sa.PrimaryKeyConstraint("batch_id", "line_no", name=op.f("pk_batch_lines")),
        sa.UniqueConstraint("batch_id", "custom_id", name=op.f("uq_batch_lines_batch_id_custom_id")),
    )


def upgrade() -> None:
    _batch_files()
    _batches()
    _batch_lines()
    op.add_column("usage_events", sa.Column("service_tier", sa.Text(), server_default="default", nullable=False))
    op.create_check_constraint(op.f("ck_usage_events_service_tier_known"), "usage_events",
                               "service_tier IN ('default', 'batch')")
    op.add_column("prices", sa.Column("batch_discount_bps", sa.Integer(), server_default=sa.text("5000"), nullable=False))
    op.create_check_constraint(op.f("ck_prices_batch_discount_range"), "prices", "batch_discount_bps BETWEEN 0 AND 10000")
    op.add_column("tenant_limits", sa.Column("monthly_batch_token_budget", sa.BigInteger(), nullable=True))
    op.create_check_constraint(op.f("ck_tenant_limits_monthly_batch_token_budget_nonneg"), "tenant_limits",
                               "monthly_batch_token_budget IS NULL OR monthly_batch_token_budget >= 0")


def downgrade() -> None:
    op.drop_constraint(op.f("ck_tenant_limits_monthly_batch_token_budget_nonneg"), "tenant_limits", type_="check")
    op.drop_column("tenant_limits", "monthly_batch_token_budget")
    op.drop_constraint(op.f("ck_prices_batch_discount_range"), "prices", type_="check")
    op.drop_column("prices", "batch_discount_bps")
    op.drop_constraint(op.f("ck_usage_events_service_tier_known"), "usage_events", type_="check")
    op.drop_column("usage_events", "service_tier")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_id_id", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_batch_files_tenant_id_created_at", table_name="batch_files")
    op.drop_table("batch_files")
