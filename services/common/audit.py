"""Who did what, for the audit log, and the tenant lookups every service's admin paths share: one owner for
the gateway's management API, the admin CLI and the adapter pipeline (which must not import the gateway)."""
from __future__ import annotations

import getpass
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from services.common.errors import NotFoundError
from services.common.models import AuditLog, Tenant


@dataclass(frozen=True, slots=True)
class Actor:
    """Who performs an action, for the audit log: a signed-in user through the API, or an operator at the CLI."""

    user_id: uuid.UUID | None
    request_id: str | None = None
    ip: str | None = None
    via: str = "api"
    operator: str | None = None  # the OS user behind a CLI action (there is no web user)

    @classmethod
    def cli(cls) -> Actor:
        try:
            operator = getpass.getuser()
        except (KeyError, OSError):
            operator = None
        return cls(user_id=None, via="cli", operator=operator)


def record_audit(
    session: Session,
    *,
    actor: Actor,
    action: str,
    tenant_id: uuid.UUID | None,
    target_type: str | None = None,
    target_id: object = None,
    details: dict[str, Any] | None = None,
) -> AuditLog:
    """Append one audit row. `details` must never hold secrets (passwords, keys): it is shown to admins."""
    full = {"via": actor.via, **({"operator": actor.operator} if actor.operator else {}), **(details or {})}
    row = AuditLog(
        actor_user_id=actor.user_id, tenant_id=tenant_id, action=action, target_type=target_type,
        target_id=None if target_id is None else str(target_id), details=full, request_id=actor.request_id, ip=actor.ip,
    )
    session.add(row)
    return row


def get_tenant(session: Session, *, tenant_id: uuid.UUID, for_update: bool = False) -> Tenant:
    tenant = session.get(Tenant, tenant_id, with_for_update=for_update, options=[selectinload(Tenant.limits)])
    if tenant is None:
        raise NotFoundError("Tenant not found.")
    return tenant


def find_tenant(session: Session, *, ref: str) -> Tenant:
    """By id or slug (the CLI accepts either)."""
    try:
        return get_tenant(session, tenant_id=uuid.UUID(ref))
    except ValueError:
        pass
    tenant = session.scalar(select(Tenant).where(Tenant.slug == ref).options(selectinload(Tenant.limits)))
    if tenant is None:
        raise NotFoundError(f"No tenant with slug or id {ref!r}.")
    return tenant
