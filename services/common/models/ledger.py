"""The usage ledger: one append-only row per request (unique request id), and engines' busy/idle reports.

Rows are never updated or deleted (a database trigger refuses it): roll-ups and statements are derived
from them and must be reproducible. Inserts are idempotent by request id (ON CONFLICT DO NOTHING).
"""
from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, ForeignKeyConstraint, Index, Integer, SmallInteger, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from services.common.models.base import Base, bigint_pk, created_at, str_enum


class UsageStatus(enum.StrEnum):
    OK = "ok"
    CANCELLED = "cancelled"  # client went away; tokens up to then are billed
    ERROR = "error"


class UsageEvent(Base):
    __tablename__ = "usage_events"
    __table_args__ = (
        # The key and the adapter version must belong to the event's tenant.
        ForeignKeyConstraint(["api_key_id", "tenant_id"], ["api_keys.id", "api_keys.tenant_id"]),
        ForeignKeyConstraint(["adapter_version_id", "tenant_id"], ["adapter_versions.id", "adapter_versions.tenant_id"]),
        CheckConstraint("prompt_tokens >= 0 AND completion_tokens >= 0", name="tokens_nonneg"),
        CheckConstraint("cached_tokens BETWEEN 0 AND prompt_tokens", name="cached_within_prompt"),
        CheckConstraint("compute_us >= 0", name="compute_nonneg"),
        CheckConstraint("service_tier IN ('default', 'batch')", name="service_tier_known"),
        Index("ix_usage_events_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_usage_events_created_at", "created_at"),
        Index("ix_usage_events_recorded_at", "recorded_at"),  # roll-ups find late arrivals by ingest time
        Index("ix_usage_events_client_request_id", "client_request_id"),
    )

    id: Mapped[int] = bigint_pk()
    request_id: Mapped[str] = mapped_column(unique=True)  # the gateway's own id (unique by construction)
    client_request_id: Mapped[str | None]  # X-Client-Request-Id as sent, for tracing across hops
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[uuid.UUID | None]
    model: Mapped[str]  # as requested: base model name, adapter name or name@version
    base_model: Mapped[str]
    adapter_version_id: Mapped[uuid.UUID | None]
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))  # part of prompt_tokens
    completion_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[UsageStatus] = mapped_column(str_enum(UsageStatus, "usage_status"))
    http_status: Mapped[int] = mapped_column(SmallInteger)
    error_code: Mapped[str | None]
    created_at: Mapped[datetime]  # event time: when the gateway accepted the request; billing periods use it
    # Milliseconds after created_at: engine started the sequence, first token out, last token out.
    started_ms: Mapped[int | None] = mapped_column(Integer)
    first_token_ms: Mapped[int | None] = mapped_column(Integer)
    finished_ms: Mapped[int | None] = mapped_column(Integer)
    engine_id: Mapped[str | None]
    compute_us: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))  # share of engine step time
    # "batch": a Batch API line (priced at the price book's batch rate, counted against the batch quota)
    service_tier: Mapped[str] = mapped_column(default="default", server_default="default")
    recorded_at: Mapped[datetime] = created_at()  # when the row landed (after a spool replay, maybe much later)


class EngineUsageReport(Base):
    """An engine's wall time over a window, split into busy (attributed to requests) and idle (unallocated)."""

    __tablename__ = "engine_usage_reports"
    __table_args__ = (
        UniqueConstraint("engine_id", "window_start"),  # a re-sent report is a no-op
        CheckConstraint("window_end > window_start", name="window_order"),
        CheckConstraint("busy_us >= 0 AND idle_us >= 0", name="durations_nonneg"),
        Index("ix_engine_usage_reports_window_start", "window_start"),
    )

    id: Mapped[int] = bigint_pk()
    engine_id: Mapped[str]
    engine_type: Mapped[str]  # engine_types.name (priced by the row effective at window_start)
    base_model: Mapped[str | None]
    window_start: Mapped[datetime]
    window_end: Mapped[datetime]
    busy_us: Mapped[int] = mapped_column(BigInteger)
    idle_us: Mapped[int] = mapped_column(BigInteger)
    recorded_at: Mapped[datetime] = created_at()
