"""Base models, tenants' adapters, their immutable versions (upload → validating → evaluating → ready |
rejected) and quality-gate eval runs."""
from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    SmallInteger,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.common.models.base import Base, created_at, str_enum, updated_at, uuid_pk

# '@' separates name and version in a request's `model`; '/' and ':' are reserved for future namespacing.
ADAPTER_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class BaseModelRecord(Base):
    """A base model the platform serves (one per engine fleet). `params` holds the dimensions adapters
    are validated against (hidden_size, intermediate_size, num_layers, heads, kv heads, head_dim, vocab)."""

    __tablename__ = "base_models"

    id: Mapped[uuid.UUID] = uuid_pk()
    name: Mapped[str] = mapped_column(unique=True)  # what clients put in `model`
    uri: Mapped[str]  # HF checkpoint directory or object-store URL
    params: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default=text("'{}'::jsonb"))
    max_lora_rank: Mapped[int] = mapped_column(Integer, default=64, server_default=text("64"))
    created_at: Mapped[datetime] = created_at()
    retired_at: Mapped[datetime | None]


class AdapterStatus(enum.StrEnum):
    UPLOADED = "uploaded"
    VALIDATING = "validating"
    EVALUATING = "evaluating"
    READY = "ready"  # routable
    REJECTED = "rejected"  # final unless a platform admin overrides (recorded)

    @property
    def is_final(self) -> bool:
        return self in (AdapterStatus.READY, AdapterStatus.REJECTED)


class Adapter(Base):
    """A tenant's named adapter: a series of versions and a pointer to the one `name` routes to."""

    __tablename__ = "adapters"
    __table_args__ = (
        CheckConstraint(f"name ~ '{ADAPTER_NAME_PATTERN}'", name="name_format"),
        UniqueConstraint("id", "tenant_id"),  # target of (adapter_id, tenant_id) foreign keys
        # Names are unique among a tenant's live adapters; a deleted adapter's name can be reused.
        Index("uq_adapters_tenant_id_name_live", "tenant_id", "name", unique=True, postgresql_where=text("deleted_at IS NULL")),
        # The active version must be one of this adapter's own versions.
        ForeignKeyConstraint(
            ["active_version_id", "id"], ["adapter_versions.id", "adapter_versions.adapter_id"],
            name="fk_adapters_active_version_own", use_alter=True,
        ),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str]
    description: Mapped[str | None]
    base_model_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("base_models.id"))
    active_version_id: Mapped[uuid.UUID | None]
    created_by: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("users.id"))
    created_at: Mapped[datetime] = created_at()
    updated_at: Mapped[datetime] = updated_at()
    deleted_at: Mapped[datetime | None]  # stops routing; versions and usage stay for billing

    versions: Mapped[list[AdapterVersion]] = relationship(
        primaryjoin="Adapter.id == foreign(AdapterVersion.adapter_id)",
        order_by="AdapterVersion.version", viewonly=True,
    )
    active_version: Mapped[AdapterVersion | None] = relationship(
        primaryjoin="foreign(Adapter.active_version_id) == AdapterVersion.id", viewonly=True,
    )


class AdapterVersion(Base):
    """One upload, immutable: content (sha256, uri, size) never changes, and rank/alpha/targets are set once
    by validation (a database trigger enforces both). Status and progress move; a new upload is a new version."""

    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version"),
        UniqueConstraint("id", "adapter_id"),  # target of adapters' active-version foreign key
        UniqueConstraint("id", "tenant_id"),  # target of (adapter_version_id, tenant_id) foreign keys
        ForeignKeyConstraint(["adapter_id", "tenant_id"], ["adapters.id", "adapters.tenant_id"]),
        CheckConstraint("version >= 1", name="version_positive"),
        CheckConstraint("content_sha256 ~ '^[0-9a-f]{64}$'", name="content_sha256_hex"),
        CheckConstraint("size_bytes >= 0", name="size_nonneg"),
        CheckConstraint("eval_set_bytes IS NULL OR eval_set_bytes >= 0", name="eval_set_bytes_nonneg"),
        CheckConstraint("rank IS NULL OR rank > 0", name="rank_positive"),
        CheckConstraint("progress_percent BETWEEN 0 AND 100", name="progress_range"),
        CheckConstraint("status <> 'ready' OR ready_at IS NOT NULL", name="ready_has_ready_at"),
        CheckConstraint(
            "(override_at IS NULL) = (override_reason IS NULL) AND (override_reason IS NULL OR length(override_reason) > 0)",
            name="override_has_reason",
        ),
        Index("ix_adapter_versions_tenant_id_status", "tenant_id", "status"),
        Index("ix_adapter_versions_content_sha256", "content_sha256"),
        # Storage garbage collection: is this object still referenced by a version that keeps its files?
        Index("ix_adapter_versions_storage_uri_kept", "storage_uri", postgresql_where=text("objects_purged_at IS NULL")),
        Index("ix_adapter_versions_eval_set_uri_kept", "eval_set_uri",
              postgresql_where=text("eval_set_uri IS NOT NULL AND objects_purged_at IS NULL")),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    adapter_id: Mapped[uuid.UUID]
    tenant_id: Mapped[uuid.UUID]  # denormalized from the adapter so tenant-scoped queries need no join
    version: Mapped[int] = mapped_column(Integer)
    base_model_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("base_models.id"))

    content_sha256: Mapped[str]  # the adapter's identity everywhere below the gateway (engines, prefix cache)
    storage_uri: Mapped[str]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    rank: Mapped[int | None] = mapped_column(Integer)
    alpha: Mapped[float | None] = mapped_column(Float)
    target_modules: Mapped[list[str] | None] = mapped_column(ARRAY(Text))

    status: Mapped[AdapterStatus] = mapped_column(
        str_enum(AdapterStatus, "adapter_status"), default=AdapterStatus.UPLOADED, server_default=AdapterStatus.UPLOADED.value
    )
    # [{"code": "rank_over_max", "message": "rank 128 exceeds the engine's maximum of 64"}, ...]
    status_reasons: Mapped[list[Any]] = mapped_column(default=list, server_default=text("'[]'::jsonb"))
    progress_percent: Mapped[int] = mapped_column(SmallInteger, default=0, server_default=text("0"))
    progress_step: Mapped[str | None]
    eval_set_uri: Mapped[str | None]  # the tenant's eval set, if uploaded with the adapter
    eval_set_bytes: Mapped[int | None] = mapped_column(BigInteger)  # its size (counted in the storage quota)
    gate_config: Mapped[dict[str, Any] | None]  # thresholds given at upload (margin, FP8 agreement, ...)
    eval_summary: Mapped[dict[str, Any] | None]

    override_by: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("users.id"))
    override_reason: Mapped[str | None] = mapped_column(Text)
    override_at: Mapped[datetime | None]

    created_by: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("users.id"))
    created_at: Mapped[datetime] = created_at()
    updated_at: Mapped[datetime] = updated_at()
    ready_at: Mapped[datetime | None]
    # Set when storage retention removed this version's files (rejected or deleted past the retention period;
    # objects another kept version references stay). Never unset; such a version never becomes ready again.
    objects_purged_at: Mapped[datetime | None]

    adapter: Mapped[Adapter] = relationship(
        primaryjoin="foreign(AdapterVersion.adapter_id) == Adapter.id", viewonly=True,
    )
    eval_runs: Mapped[list[EvalRun]] = relationship(back_populates="version", order_by="EvalRun.attempt")


class EvalRunStatus(enum.StrEnum):
    RUNNING = "running"
    FINISHED = "finished"  # a decision was reached
    FAILED = "failed"  # the run itself broke (not the adapter); a retry makes a new attempt


class GateDecision(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"


class EvalRun(Base):
    """One quality-gate run of a version. (version, attempt) is unique, so a redelivered task that
    re-inserts its attempt collides instead of recording a second run."""

    __tablename__ = "eval_runs"
    __table_args__ = (
        UniqueConstraint("adapter_version_id", "attempt"),
        CheckConstraint("attempt >= 1", name="attempt_positive"),
        CheckConstraint("(status = 'running') = (finished_at IS NULL)", name="finished_iff_not_running"),
        CheckConstraint("(status = 'finished') = (decision IS NOT NULL)", name="decision_iff_finished"),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    adapter_version_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("adapter_versions.id"))
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    status: Mapped[EvalRunStatus] = mapped_column(
        str_enum(EvalRunStatus, "eval_run_status"), default=EvalRunStatus.RUNNING, server_default=EvalRunStatus.RUNNING.value
    )
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default=text("'{}'::jsonb"))
    examples: Mapped[list[Any]] = mapped_column(default=list, server_default=text("'[]'::jsonb"))  # per-example outputs
    decision: Mapped[GateDecision | None] = mapped_column(str_enum(GateDecision, "gate_decision"))
    reasons: Mapped[list[Any]] = mapped_column(default=list, server_default=text("'[]'::jsonb"))
    task_id: Mapped[str | None]  # the Celery task that ran it
    started_at: Mapped[datetime] = created_at()
    finished_at: Mapped[datetime | None]

    version: Mapped[AdapterVersion] = relationship(back_populates="eval_runs")
