"""Who can act: web users (with roles) and their sessions, and tenants' API keys."""
from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, ForeignKey, Index, Text, UniqueConstraint, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.common.keys import DEFAULT_SCOPES, PREFIX_LEN
from services.common.models.base import Base, created_at, str_enum, uuid_pk
from services.common.models.tenants import LimitColumns, Tenant, limit_checks


class Role(enum.StrEnum):
    TENANT_MEMBER = "tenant_member"  # reads its tenant's usage, keys (not secrets) and adapters
    TENANT_ADMIN = "tenant_admin"  # + creates/revokes keys, uploads adapters for its tenant
    PLATFORM_ADMIN = "platform_admin"  # every tenant: create/suspend, limits, uploads, gate overrides
    FINANCE = "finance"  # cost reports and exports across tenants

    @property
    def is_tenant_role(self) -> bool:
        return self in (Role.TENANT_MEMBER, Role.TENANT_ADMIN)


TENANT_ROLES_SQL = "('tenant_member', 'tenant_admin')"


class User(Base):
    __tablename__ = "users"
    __table_args__ = (
        # Tenant roles belong to exactly one tenant; platform roles to none (no accidental tenant scoping).
        CheckConstraint(f"(role IN {TENANT_ROLES_SQL}) = (tenant_id IS NOT NULL)", name="tenant_matches_role"),
        CheckConstraint("email = lower(email) AND position('@' in email) > 1", name="email_normalized"),
        Index("ix_users_tenant_id", "tenant_id"),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    email: Mapped[str] = mapped_column(unique=True)  # stored lower-case
    password_hash: Mapped[str]  # argon2id (services.common.passwords)
    role: Mapped[Role] = mapped_column(str_enum(Role, "user_role"))
    tenant_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("tenants.id"))
    display_name: Mapped[str | None]
    created_at: Mapped[datetime] = created_at()
    last_login_at: Mapped[datetime | None]
    disabled_at: Mapped[datetime | None]

    tenant: Mapped[Tenant | None] = relationship()


class WebSession(Base):
    """A signed-in browser. The cookie holds a random token; only its sha256 is stored (as the id)."""

    __tablename__ = "web_sessions"
    __table_args__ = (
        CheckConstraint("length(id) = 64", name="id_is_sha256"),
        Index("ix_web_sessions_user_id", "user_id"),
        Index("ix_web_sessions_expires_at", "expires_at"),
    )

    id: Mapped[str] = mapped_column(primary_key=True)
    user_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    csrf_token_hash: Mapped[str]
    created_at: Mapped[datetime] = created_at()
    expires_at: Mapped[datetime]
    last_seen_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    user_agent: Mapped[str | None]
    ip: Mapped[str | None]

    user: Mapped[User] = relationship()


class ApiKey(LimitColumns, Base):
    """`mpx_<prefix>_<secret><checksum>`: the prefix is public and unique; the full key is stored as sha256 only."""

    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint(f"length(prefix) = {PREFIX_LEN}", name="prefix_length"),
        CheckConstraint("key_hash ~ '^[0-9a-f]{64}$'", name="key_hash_sha256"),
        UniqueConstraint("id", "tenant_id"),  # target of (api_key_id, tenant_id) foreign keys
        Index("ix_api_keys_tenant_id", "tenant_id"),
        *limit_checks(),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    prefix: Mapped[str] = mapped_column(unique=True)
    key_hash: Mapped[str] = mapped_column(unique=True)
    name: Mapped[str]
    scopes: Mapped[list[str]] = mapped_column(
        ARRAY(Text), default=lambda: list(DEFAULT_SCOPES),
        server_default=text("ARRAY[" + ", ".join(f"'{s}'" for s in DEFAULT_SCOPES) + "]::text[]"),
    )
    created_by: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("users.id"))
    created_at: Mapped[datetime] = created_at()
    last_used_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]

    tenant: Mapped[Tenant] = relationship()

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None
