"""Batch usage apart in money: daily roll-ups and statement lines carry the service tier.

- usage_daily.service_tier ('default' | 'batch'), part of the natural key (the unique constraint becomes
  uq_usage_daily_natural_key): a day's batch lines are their own row, priced at the batch rate and rounded
  once, beside the live row of the same model and adapter.
- statement_lines.service_tier: a statement has a line per model/adapter version and tier. Issued statements
  stay as they were (immutable; their lines are 'default').
- Data: the daily rows of (day, tenant) pairs that hold batch lines are removed and the roll-up cursor is
  moved back to the first such ledger row, so the next roll-up (and every reader meanwhile, which computes
  pairs past the cursor live) splits them by tier. Totals are unchanged but for the rounding, which is now
  once per tier's row.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_KEY = "uq_usage_daily_day_tenant_id_model_adapter_version_id"
_NEW_KEY = "uq_usage_daily_natural_key"  # the conventional name would pass Postgres's 63 characters


def _tier() -> sa.Column:
    return sa.Column("service_tier", sa.Text(), server_default="default", nullable=False)


def upgrade() -> None:
    for table in ("usage_daily", "statement_lines"):
        op.add_column(table, _tier())
        op.create_check_constraint(op.f(f"ck_{table}_service_tier_known"), table, "service_tier IN ('default', 'batch')")
    op.drop_constraint(_OLD_KEY, "usage_daily", type_="unique")
    op.create_unique_constraint(_NEW_KEY, "usage_daily", ["day", "tenant_id", "model", "adapter_version_id", "service_tier"],
                                postgresql_nulls_not_distinct=True)
    op.execute("""
        DELETE FROM usage_daily d USING (
            SELECT DISTINCT (created_at AT TIME ZONE 'UTC')::date AS day, tenant_id FROM usage_events
            WHERE service_tier = 'batch') b
        WHERE d.day = b.day AND d.tenant_id = b.tenant_id""")
    op.execute("""
        UPDATE billing_cursors SET recorded_through = least(recorded_through,
            (SELECT min(recorded_at) FROM usage_events WHERE service_tier = 'batch')), updated_at = now()
        WHERE name = 'usage_daily' AND EXISTS (SELECT 1 FROM usage_events WHERE service_tier = 'batch')""")


def downgrade() -> None:
    # Batch rows fold back into their live rows' key: remove the split days and let the roll-up redo them.
    op.execute("""
        UPDATE billing_cursors SET recorded_through = least(recorded_through,
            (SELECT min(recorded_at) FROM usage_events WHERE service_tier = 'batch')), updated_at = now()
        WHERE name = 'usage_daily' AND EXISTS (SELECT 1 FROM usage_events WHERE service_tier = 'batch')""")
    op.execute("DELETE FROM usage_daily d USING (SELECT DISTINCT day, tenant_id FROM usage_daily WHERE service_tier = 'batch') b "
               "WHERE d.day = b.day AND d.tenant_id = b.tenant_id")
    op.drop_constraint(_NEW_KEY, "usage_daily", type_="unique")
    op.create_unique_constraint(_OLD_KEY, "usage_daily", ["day", "tenant_id", "model", "adapter_version_id"],
                                postgresql_nulls_not_distinct=True)
    for table in ("statement_lines", "usage_daily"):
        op.drop_constraint(op.f(f"ck_{table}_service_tier_known"), table, type_="check")
        op.drop_column(table, "service_tier")
