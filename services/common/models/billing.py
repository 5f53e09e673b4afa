"""Derived billing tables: daily roll-ups (idempotent upserts on their natural key) and monthly
statements (immutable snapshots; re-issuing adds a revision, never edits)."""
from __future__ import annotations

import uuid
from datetime import date, datetime

from sqlalchemy import BigInteger, CheckConstraint, Date, ForeignKey, ForeignKeyConstraint, Index, Integer, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.common.models.base import Base, bigint_pk, created_at, micros, updated_at, uuid_pk


def _bigint0() -> Mapped[int]:
    return mapped_column(BigInteger, default=0, server_default="0")


class UsageTotals:
    """Sums over ledger rows, shared by roll-ups, statements and their lines."""

    requests: Mapped[int] = _bigint0()
    prompt_tokens: Mapped[int] = _bigint0()
    cached_tokens: Mapped[int] = _bigint0()
    completion_tokens: Mapped[int] = _bigint0()
    compute_us: Mapped[int] = _bigint0()
    amount_micros: Mapped[int] = micros(default=0)  # at the unit prices effective at each event's time (list or contract)
    discount_micros: Mapped[int] = micros(default=0)  # contract discount (discount_bps); billed = amount - discount
    compute_cost_micros: Mapped[int] = micros(default=0)  # attributed engine cost


class UsageDaily(UsageTotals, Base):
    __tablename__ = "usage_daily"
    __table_args__ = (
        # The natural key; NULLS NOT DISTINCT (PostgreSQL 15+) so base-model rows (no adapter) upsert too.
        # Named by hand: the conventional name would pass Postgres's 63 characters.
        UniqueConstraint("day", "tenant_id", "model", "adapter_version_id", "service_tier",
                         name="uq_usage_daily_natural_key", postgresql_nulls_not_distinct=True),
        CheckConstraint("service_tier IN ('default', 'batch')", name="service_tier_known"),
        ForeignKeyConstraint(["adapter_version_id", "tenant_id"], ["adapter_versions.id", "adapter_versions.tenant_id"]),
        Index("ix_usage_daily_tenant_id_day", "tenant_id", "day"),
    )

    id: Mapped[int] = bigint_pk()
    day: Mapped[date] = mapped_column(Date)  # UTC day of the events' created_at
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    model: Mapped[str]
    base_model: Mapped[str]
    adapter_version_id: Mapped[uuid.UUID | None]
    # 'batch': Batch API lines (at the price book's batch rate), a row apart from the live ('default') one
    service_tier: Mapped[str] = mapped_column(default="default", server_default="default")
    # Requests with no list price at their time (amount counted as 0) and compute time with no engine-hour
    # price (cost counted as 0): a statement refuses a month with unpriced requests; reports show both.
    unpriced_requests: Mapped[int] = _bigint0()
    uncosted_compute_us: Mapped[int] = _bigint0()
    updated_at: Mapped[datetime] = updated_at()


class BillingCursor(Base):
    """How far (by ledger `recorded_at`) a derived table has been brought up to date; roll-ups resume here."""

    __tablename__ = "billing_cursors"

    name: Mapped[str] = mapped_column(primary_key=True)
    recorded_through: Mapped[datetime]
    updated_at: Mapped[datetime] = updated_at()


class Statement(UsageTotals, Base):
    """A tenant's month. Rows are immutable (trigger); a corrected month is a new revision."""

    __tablename__ = "statements"
    __table_args__ = (
        UniqueConstraint("tenant_id", "period", "revision"),
        CheckConstraint("extract(day from period) = 1", name="period_is_month_start"),
        CheckConstraint("revision >= 1", name="revision_positive"),
        CheckConstraint("total_micros = amount_micros - discount_micros", name="total_adds_up"),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    period: Mapped[date] = mapped_column(Date)  # first day of the month (UTC)
    revision: Mapped[int] = mapped_column(Integer)
    currency: Mapped[str] = mapped_column(default="USD", server_default="USD")
    total_micros: Mapped[int] = micros()
    ledger_digest: Mapped[str | None]  # hash of the inputs, so an unchanged month is not re-issued
    issued_by: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("users.id"))
    issued_at: Mapped[datetime] = created_at()

    lines: Mapped[list[StatementLine]] = relationship(order_by="StatementLine.line_no")


class StatementLine(UsageTotals, Base):
    __tablename__ = "statement_lines"
    __table_args__ = (
        UniqueConstraint("statement_id", "line_no"),
        CheckConstraint("service_tier IN ('default', 'batch')", name="service_tier_known"),
    )

    id: Mapped[int] = bigint_pk()
    statement_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("statements.id"))
    line_no: Mapped[int] = mapped_column(Integer)
    model: Mapped[str]
    base_model: Mapped[str]
    adapter_version_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("adapter_versions.id"))
    description: Mapped[str]
    service_tier: Mapped[str] = mapped_column(default="default", server_default="default")  # as in usage_daily
