"""Billing roll-ups keep the contract discount beside the amount, flag unpriced usage, and remember how far
(by ledger ingest time) they have been brought up to date.

- usage_daily, statement_lines: `discount_micros` (billed = amount - discount, as statements already do).
- usage_daily: `unpriced_requests` (no list price at the event's time) and `uncosted_compute_us` (no
  engine-hour price): counted as 0 and shown, instead of failing every tenant's roll-up for one gap.
- billing_cursors: the `recorded_at` high-water mark a roll-up resumes from (late events are found by it).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _bigint0(name: str) -> sa.Column:
    return sa.Column(name, sa.BigInteger(), server_default=sa.text("0"), nullable=False)


def upgrade() -> None:
    # Adding a NOT NULL column with a constant default is a catalog-only change (no rewrite) on PG 11+;
    # statement_lines are append-only by trigger, but ALTER TABLE is DDL, not a row UPDATE.
    op.add_column("usage_daily", _bigint0("discount_micros"))
    op.add_column("usage_daily", _bigint0("unpriced_requests"))
    op.add_column("usage_daily", _bigint0("uncosted_compute_us"))
    op.add_column("statement_lines", _bigint0("discount_micros"))
    op.create_table(
        "billing_cursors",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("recorded_through", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_billing_cursors")),
    )


def downgrade() -> None:
    op.drop_table("billing_cursors")
    op.drop_column("statement_lines", "discount_micros")
    op.drop_column("usage_daily", "uncosted_compute_us")
    op.drop_column("usage_daily", "unpriced_requests")
    op.drop_column("usage_daily", "discount_micros")
