"""The price book: effective-dated list prices per base model and plan, per-tenant overrides, and
engine-hour prices per engine type (what serving costs us). All amounts are integer micro-USD."""
from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, ForeignKey, Integer, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from services.common.models.base import Base, created_at, micros, uuid_pk

# column -> short name for its constraints (Postgres truncates identifiers at 63 bytes)
_PRICE_COLUMNS = {
    "input_per_mtok_micros": "input",
    "cached_input_per_mtok_micros": "cached_input",
    "output_per_mtok_micros": "output",
    "adapter_surcharge_per_mtok_micros": "surcharge",
}


class Price(Base):
    """List price from `effective_from` until the next row for the same (base_model, plan)."""

    __tablename__ = "prices"
    __table_args__ = (
        UniqueConstraint("base_model", "plan", "effective_from"),
        *(CheckConstraint(f"{c} >= 0", name=f"{short}_nonneg") for c, short in _PRICE_COLUMNS.items()),
        CheckConstraint("batch_discount_bps BETWEEN 0 AND 10000", name="batch_discount_range"),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    base_model: Mapped[str] = mapped_column(ForeignKey("base_models.name", onupdate="CASCADE"))
    plan: Mapped[str]
    effective_from: Mapped[datetime]
    input_per_mtok_micros: Mapped[int] = micros()  # per 1,000,000 prompt tokens not served from cache
    cached_input_per_mtok_micros: Mapped[int] = micros()  # per 1,000,000 prompt tokens served from the prefix cache
    output_per_mtok_micros: Mapped[int] = micros()
    adapter_surcharge_per_mtok_micros: Mapped[int] = micros(default=0)  # on all tokens of adapter requests
    # The Batch API's rate: this share off the amount of batch lines (after any contract discount)
    batch_discount_bps: Mapped[int] = mapped_column(Integer, default=5000, server_default=text("5000"))
    created_by: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("users.id"))
    created_at: Mapped[datetime] = created_at()


class TenantPriceOverride(Base):
    """A contract for one tenant, on one base model (or all when NULL), for [effective_from, effective_to):
    either a discount in basis points off list, or explicit prices (NULL columns fall back to list)."""

    __tablename__ = "tenant_price_overrides"
    __table_args__ = (
        UniqueConstraint("tenant_id", "base_model", "effective_from", postgresql_nulls_not_distinct=True),
        CheckConstraint("discount_bps IS NULL OR discount_bps BETWEEN 0 AND 10000", name="discount_range"),
        CheckConstraint(
            "discount_bps IS NOT NULL OR " + " OR ".join(f"{c} IS NOT NULL" for c in _PRICE_COLUMNS), name="says_something"
        ),
        CheckConstraint("effective_to IS NULL OR effective_to > effective_from", name="period_order"),
        *(CheckConstraint(f"{c} IS NULL OR {c} >= 0", name=f"{short}_nonneg") for c, short in _PRICE_COLUMNS.items()),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    base_model: Mapped[str | None] = mapped_column(ForeignKey("base_models.name", onupdate="CASCADE"))
    effective_from: Mapped[datetime]
    effective_to: Mapped[datetime | None]
    discount_bps: Mapped[int | None] = mapped_column(Integer)
    input_per_mtok_micros: Mapped[int | None] = micros(nullable=True)
    cached_input_per_mtok_micros: Mapped[int | None] = micros(nullable=True)
    output_per_mtok_micros: Mapped[int | None] = micros(nullable=True)
    adapter_surcharge_per_mtok_micros: Mapped[int | None] = micros(nullable=True)
    note: Mapped[str | None]
    created_by: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("users.id"))
    created_at: Mapped[datetime] = created_at()


class EngineType(Base):
    """What one engine-hour of a hardware type costs us, effective-dated (e.g. H100, cpu)."""

    __tablename__ = "engine_types"
    __table_args__ = (
        UniqueConstraint("name", "effective_from"),
        CheckConstraint("price_per_hour_micros >= 0", name="price_nonneg"),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    name: Mapped[str]
    effective_from: Mapped[datetime]
    price_per_hour_micros: Mapped[int] = micros()
    description: Mapped[str | None]
    created_at: Mapped[datetime] = created_at()
