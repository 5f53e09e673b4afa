"""Audit log of administrative actions (append-only; a trigger refuses updates and deletes)."""
from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, text
from sqlalchemy.orm import Mapped, mapped_column

from services.common.models.base import Base, bigint_pk, created_at


class AuditLog(Base):
    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_tenant_id_at", "tenant_id", "at"),
        Index("ix_audit_log_at", "at"),
    )

    id: Mapped[int] = bigint_pk()
    at: Mapped[datetime] = created_at()
    actor_user_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("users.id"))  # NULL: the system (a task)
    tenant_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("tenants.id"))  # the tenant acted upon, if any
    action: Mapped[str]  # dotted verb: "tenant.suspend", "key.revoke", "adapter.override", "statement.issue"
    target_type: Mapped[str | None]
    target_id: Mapped[str | None]
    details: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default=text("'{}'::jsonb"))
    request_id: Mapped[str | None]
    ip: Mapped[str | None]
