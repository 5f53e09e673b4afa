"""Demo data for local runs (`make up`): the `demo` tenant with limits, one user per role with known dev
passwords, and a demo API key. Idempotent: running it again changes nothing that is already right.

Dev only — the passwords are in this file. The CLI refuses to seed when MPLEX_ENV=prod.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.common.audit import Actor
from services.common.keys import InvalidKeyFormat, parse_key, verify_key
from services.common.models import ApiKey, Role, Tenant, TenantLimits, User
from services.common.passwords import hash_password, verify_password
from services.gateway import crud

DEMO_SLUG = "demo"
DEMO_NAME = "Demo Tenant"
DEMO_KEY_NAME = "demo"
DEMO_LIMITS: dict[str, int | None] = {
    "tokens_per_min": 200_000,
    "requests_per_min": 600,
    "concurrent_requests": 32,
    "monthly_token_budget": 50_000_000,
}


@dataclass(frozen=True, slots=True)
class DemoUser:
    email: str
    password: str
    role: Role

    @property
    def in_tenant(self) -> bool:
        return self.role.is_tenant_role


DEMO_USERS: tuple[DemoUser, ...] = (
    DemoUser("admin@demo.test", "demo-admin-pass", Role.TENANT_ADMIN),
    DemoUser("member@demo.test", "demo-member-pass", Role.TENANT_MEMBER),
    DemoUser("platform@multiplex.test", "platform-admin-pass", Role.PLATFORM_ADMIN),
    DemoUser("finance@multiplex.test", "finance-demo-pass", Role.FINANCE),
)


@dataclass(frozen=True, slots=True)
class DemoSeed:
    tenant_id: uuid.UUID
    tenant_slug: str
    api_key: str  # the full key: reused from `existing_key` when still valid, else freshly created
    key_created: bool
    users: tuple[DemoUser, ...]

    def __repr__(self) -> str:  # keep the key out of logs and tracebacks
        return f"DemoSeed(tenant_slug={self.tenant_slug!r}, key_created={self.key_created})"

    def as_dict(self) -> dict:
        """What `make up` writes to .mplex/dev.json."""
        return {
            "tenant": self.tenant_slug,
            "tenant_id": str(self.tenant_id),
            "api_key": self.api_key,
            "users": [{"email": u.email, "password": u.password, "role": str(u.role)} for u in self.users],
        }


_ACTOR = Actor(user_id=None, via="seed")


def _ensure_tenant(session: Session, limits: dict[str, int | None]) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.slug == DEMO_SLUG))
    if tenant is None:
        return crud.create_tenant(session, name=DEMO_NAME, slug=DEMO_SLUG, plan="default", limits=limits, actor=_ACTOR)
    if session.get(TenantLimits, tenant.id) is None:  # an older seed without limits; a developer's edits are kept
        crud.set_limits(session, tenant_id=tenant.id, limits=limits, actor=_ACTOR)
    return tenant


def _ensure_user(session: Session, spec: DemoUser, tenant: Tenant) -> None:
    tenant_id = tenant.id if spec.in_tenant else None
    user = session.scalar(select(User).where(User.email == spec.email))
    if user is None:
        crud.create_user(session, email=spec.email, password=spec.password, role=spec.role, tenant_id=tenant_id,
                         actor=_ACTOR)
        return
    # Make the documented sign-in work again, whatever a developer changed.
    user.role, user.tenant_id, user.disabled_at = spec.role, tenant_id, None
    if not verify_password(user.password_hash, spec.password):
        user.password_hash = hash_password(spec.password)
    session.flush()


def _still_valid(session: Session, key: str | None, tenant: Tenant) -> bool:
    if not key:
        return False
    try:
        parsed = parse_key(key)
    except InvalidKeyFormat:
        return False
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == parsed.prefix, ApiKey.tenant_id == tenant.id))
    return row is not None and row.revoked_at is None and row.expires_at is None and verify_key(parsed, row.key_hash)


def seed_demo(session: Session, *, existing_key: str | None = None,
              limits: dict[str, int | None] | None = None) -> DemoSeed:
    """Create what is missing; flushes, the caller commits. A key's secret cannot be read back, so
    `existing_key` (e.g. from the previous dev.json) is returned when it is still valid, else a new key
    is made."""
    tenant = _ensure_tenant(session, DEMO_LIMITS if limits is None else limits)
    for spec in DEMO_USERS:
        _ensure_user(session, spec, tenant)
    if _still_valid(session, existing_key, tenant):
        return DemoSeed(tenant.id, tenant.slug, existing_key, False, DEMO_USERS)
    _, full = crud.create_api_key(session, tenant_id=tenant.id, name=DEMO_KEY_NAME, actor=_ACTOR)
    return DemoSeed(tenant.id, tenant.slug, full, True, DEMO_USERS)
