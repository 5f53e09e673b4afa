"""Tenants and their limits (the quota windows the gateway enforces in Redis)."""
from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Integer
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.common.models.base import Base, created_at, str_enum, updated_at, uuid_pk

SLUG_PATTERN = "^[a-z0-9][a-z0-9-]{1,62}$"


class TenantStatus(enum.StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"  # keys stop working; data and statements stay


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint(f"slug ~ '{SLUG_PATTERN}'", name="slug_format"),)

    id: Mapped[uuid.UUID] = uuid_pk()
    name: Mapped[str]
    slug: Mapped[str] = mapped_column(unique=True)
    status: Mapped[TenantStatus] = mapped_column(
        str_enum(TenantStatus, "tenant_status"), default=TenantStatus.ACTIVE, server_default=TenantStatus.ACTIVE.value
    )
    plan: Mapped[str] = mapped_column(default="default", server_default="default")  # selects the price book rows
    created_at: Mapped[datetime] = created_at()
    updated_at: Mapped[datetime] = updated_at()

    limits: Mapped[TenantLimits | None] = relationship(back_populates="tenant", uselist=False)

    @property
    def is_active(self) -> bool:
        return self.status == TenantStatus.ACTIVE


def limit_checks() -> tuple[CheckConstraint, ...]:
    return tuple(
        CheckConstraint(f"{col} IS NULL OR {col} >= 0", name=f"{col}_nonneg")
        for col in ("tokens_per_min", "requests_per_min", "concurrent_requests", "monthly_token_budget")
    )


class LimitColumns:
    """Quota windows; NULL = unlimited at this level. A key's windows apply on top of its tenant's."""

    tokens_per_min: Mapped[int | None] = mapped_column(BigInteger)
    requests_per_min: Mapped[int | None] = mapped_column(Integer)
    concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)  # calendar month, UTC


class TenantLimits(LimitColumns, Base):
    __tablename__ = "tenant_limits"
    __table_args__ = (
        *limit_checks(),
        CheckConstraint("storage_quota_bytes IS NULL OR storage_quota_bytes >= 0", name="storage_quota_bytes_nonneg"),
        CheckConstraint("monthly_batch_token_budget IS NULL OR monthly_batch_token_budget >= 0",
                        name="monthly_batch_token_budget_nonneg"),
    )

    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    # Bytes of adapter storage (files and eval sets) the tenant may keep. Unlike the windows above, NULL is
    # not "unlimited" but the platform default (MPLEX_ADAPTERS_STORAGE_QUOTA_BYTES): a deployment's default
    # then applies to every tenant that was never given its own.
    storage_quota_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # Batch API tokens a calendar month (UTC), apart from the live windows above; NULL = unlimited.
    monthly_batch_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = updated_at()

    tenant: Mapped[Tenant] = relationship(back_populates="limits")


__all__ = ["SLUG_PATTERN", "LimitColumns", "Tenant", "TenantLimits", "TenantStatus", "limit_checks"]
