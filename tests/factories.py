"""Row factories for tests: unique by default, committed (so servers a test starts can see them).

    tenant = make_tenant(db, limits={"tokens_per_min": 1000})
    admin = make_user(db, tenant=tenant, role=Role.TENANT_ADMIN)
    key = make_api_key(db, tenant=tenant)        # key.secret is the bearer token, key.row the ApiKey
"""
from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.common.ids import new_request_id
from services.common.keys import DEFAULT_SCOPES, generate_key
from services.common.models import (
    Adapter,
    AdapterStatus,
    AdapterVersion,
    ApiKey,
    BaseModelRecord,
    Role,
    Tenant,
    TenantLimits,
    TenantStatus,
    UsageEvent,
    UsageStatus,
    User,
)
from services.common.passwords import hash_password

DEFAULT_PASSWORD = "correct horse battery staple"
DEMO_BASE_MODEL = "mplex-demo"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@lru_cache(maxsize=8)
def _password_hash(password: str) -> str:
    # argon2 costs ~0.1 s by design; a salted hash can be shared between test users with one password.
    return hash_password(password)


def make_tenant(
    db: Session,
    *,
    name: str | None = None,
    slug: str | None = None,
    plan: str = "default",
    status: TenantStatus = TenantStatus.ACTIVE,
    limits: dict[str, int | None] | None = None,
) -> Tenant:
    slug = slug or unique("t")
    tenant = Tenant(name=name or f"Tenant {slug}", slug=slug, plan=plan, status=status)
    db.add(tenant)
    db.flush()
    if limits is not None:
        db.add(TenantLimits(tenant_id=tenant.id, **limits))
    db.commit()
    return tenant


def make_user(
    db: Session,
    *,
    tenant: Tenant | None = None,
    role: Role | None = None,
    email: str | None = None,
    password: str = DEFAULT_PASSWORD,
) -> User:
    """A tenant member by default when `tenant` is given, else a platform admin."""
    role = role or (Role.TENANT_MEMBER if tenant is not None else Role.PLATFORM_ADMIN)
    user = User(
        email=(email or f"{unique('user')}@example.test").lower(),
        password_hash=_password_hash(password),
        role=role,
        tenant_id=tenant.id if tenant is not None else None,
    )
    db.add(user)
    db.commit()
    return user


@dataclass(frozen=True)
class CreatedKey:
    row: ApiKey
    secret: str  # the full `mpx_...` bearer token

    def __repr__(self) -> str:
        return f"CreatedKey(prefix={self.row.prefix!r})"


def make_api_key(
    db: Session,
    *,
    tenant: Tenant,
    name: str | None = None,
    scopes: tuple[str, ...] | list[str] = DEFAULT_SCOPES,
    created_by: User | None = None,
    revoked: bool = False,
    **limits: int | None,
) -> CreatedKey:
    new = generate_key()
    row = ApiKey(
        tenant_id=tenant.id,
        prefix=new.prefix,
        key_hash=new.hash,
        name=name or unique("key"),
        scopes=list(scopes),
        created_by=created_by.id if created_by is not None else None,
        revoked_at=datetime.now(timezone.utc) if revoked else None,
        **limits,
    )
    db.add(row)
    db.commit()
    return CreatedKey(row=row, secret=new.full)


def make_base_model(db: Session, *, name: str = DEMO_BASE_MODEL, uri: str = "file:///models/demo", **params: Any) -> BaseModelRecord:
    """Get-or-create by name: base models are shared by all tenants."""
    existing = db.scalar(select(BaseModelRecord).where(BaseModelRecord.name == name))
    if existing is not None:
        return existing
    row = BaseModelRecord(name=name, uri=uri, params=params)
    db.add(row)
    db.commit()
    return row


def make_adapter(db: Session, *, tenant: Tenant, name: str | None = None, base_model: BaseModelRecord | None = None) -> Adapter:
    base_model = base_model or make_base_model(db)
    adapter = Adapter(tenant_id=tenant.id, name=name or unique("adapter"), base_model_id=base_model.id)
    db.add(adapter)
    db.commit()
    return adapter


def make_adapter_version(
    db: Session,
    *,
    adapter: Adapter,
    version: int | None = None,
    content: bytes | None = None,
    status: AdapterStatus = AdapterStatus.UPLOADED,
    rank: int | None = None,
    activate: bool = False,
) -> AdapterVersion:
    if version is None:
        version = 1 + max((v.version for v in db.scalars(select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id))), default=0)
    content = content if content is not None else uuid.uuid4().bytes
    sha = hashlib.sha256(content).hexdigest()
    row = AdapterVersion(
        adapter_id=adapter.id,
        tenant_id=adapter.tenant_id,
        version=version,
        base_model_id=adapter.base_model_id,
        content_sha256=sha,
        storage_uri=f"file:///objects/{sha[:2]}/{sha}",
        size_bytes=len(content),
        rank=rank,
        status=status,
        ready_at=datetime.now(timezone.utc) if status == AdapterStatus.READY else None,
    )
    db.add(row)
    db.flush()
    if activate:
        adapter.active_version_id = row.id
    db.commit()
    return row


def make_usage_event(
    db: Session,
    *,
    tenant: Tenant,
    api_key: ApiKey | None = None,
    adapter_version: AdapterVersion | None = None,
    model: str | None = None,
    base_model: str = DEMO_BASE_MODEL,
    prompt_tokens: int = 10,
    cached_tokens: int = 0,
    completion_tokens: int = 5,
    status: UsageStatus = UsageStatus.OK,
    created_at: datetime | None = None,
    request_id: str | None = None,
    compute_us: int = 0,
    service_tier: str = "default",
) -> UsageEvent:
    row = UsageEvent(
        request_id=request_id or new_request_id(),
        tenant_id=tenant.id,
        api_key_id=api_key.id if api_key is not None else None,
        model=model or base_model,
        base_model=base_model,
        adapter_version_id=adapter_version.id if adapter_version is not None else None,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        status=status,
        http_status=200 if status == UsageStatus.OK else 499 if status == UsageStatus.CANCELLED else 500,
        created_at=created_at or datetime.now(timezone.utc),
        compute_us=compute_us,
        service_tier=service_tier,
    )
    db.add(row)
    db.commit()
    return row


def make_key_auth(database_url: str, redis_url: str, *, pool_size: int = 4, cache_ttl_s: float = 60.0):
    """A gateway KeyAuth of its own (its own Redis client and database pool), as the gateway builds one."""
    from services.common.db import make_db_engine, make_sessionmaker
    from services.gateway.auth import KeyAuth
    from services.gateway.state import make_redis

    return KeyAuth(make_redis(redis_url), make_sessionmaker(make_db_engine(database_url, pool_size=pool_size)),
                   "s" * 32, cache_ttl_s)
