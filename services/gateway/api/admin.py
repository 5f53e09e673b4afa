"""The platform admin's API (role platform_admin): tenants, their users and limits, adapter gate overrides,
rollback and delete, and the engine fleet. Every action writes an audit_log row (crud does, in the same
transaction).

Changes that the request path caches take effect quickly: a tenant's status, plan or limits drop its
keys' cache entries (so the next request re-reads them); adapter changes drop this gateway's model
resolution cache (other gateways' expire within ModelResolver's TTL, 2 s).
"""
from __future__ import annotations

import uuid
from typing import Annotated, Literal

from datetime import datetime, timezone

import anyio.from_thread
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from sqlalchemy import func, select

from services.billing.config import BillingConfig
from services.billing.rollup import current_daily_rows
from services.billing.statements import month_end
from services.common.audit import get_tenant
from services.common.models import AdapterVersion, Tenant, User
from services.gateway import crud
from services.gateway.api.auth import actor_of, drop_cached_keys
from services.gateway.api.views import (
    AdapterOut,
    AdminAdapterOut,
    AdminTenantOut,
    ListOf,
    StorageOut,
    TenantOut,
    TenantUserOut,
    UserOut,
    VersionOut,
    adapter_out,
    admin_tenant_out,
    storage_out,
    tenant_out,
    tenant_user_out,
    user_out,
    version_out,
)
from services.gateway.deps import GatewayDep, PlatformAdmin, SessionDep
from services.gateway.state import Gateway

router = APIRouter(prefix="/api/admin", tags=["admin"])

_ERRORS = {401: {}, 403: {}}
_ERRORS_404 = {**_ERRORS, 404: {}}

Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=crud.MAX_NAME_LEN)]
BigLimit = Annotated[int, Field(ge=0, le=crud.LIMIT_FIELDS["tokens_per_min"])]
IntLimit = Annotated[int, Field(ge=0, le=crud.LIMIT_FIELDS["requests_per_min"])]


class LimitsIn(BaseModel):
    """Each window: an integer, or null for unlimited. On create, a window left out gets the new-tenant
    default (crud.NEW_TENANT_LIMITS); on PATCH, it keeps its value."""

    model_config = ConfigDict(extra="forbid")
    tokens_per_min: BigLimit | None = None
    requests_per_min: IntLimit | None = None
    concurrent_requests: IntLimit | None = None
    monthly_token_budget: BigLimit | None = None

    def given(self) -> dict[str, int | None]:
        return self.model_dump(exclude_unset=True)


class TenantCreate(BaseModel):
    name: Name
    slug: Annotated[str, StringConstraints(max_length=63)]
    plan: Name = "default"
    limits: LimitsIn | None = None


class TenantPatch(BaseModel):
    name: Name | None = None
    plan: Name | None = None
    status: Literal["active", "suspended"] | None = None
    limits: LimitsIn | None = None


class StorageQuotaIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    quota_bytes: Annotated[int, Field(ge=0, le=crud.MAX_STORAGE_QUOTA_BYTES)] | None  # null: the platform default


class UserCreate(BaseModel):
    email: Annotated[str, StringConstraints(min_length=3, max_length=254)]
    password: Annotated[str, StringConstraints(max_length=1024)]
    role: Literal["tenant_member", "tenant_admin"]


class OverrideIn(BaseModel):
    decision: Literal["ready", "rejected"]
    reason: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=2000)]


class RollbackIn(BaseModel):
    version: Annotated[int, Field(ge=1, le=2**31 - 1)]


def _forget_resolutions(gw: Gateway, tenant_id: uuid.UUID) -> None:
    anyio.from_thread.run_sync(gw.resolver.forget, tenant_id)  # on the event loop, which owns that cache


def _override_names(db, versions: list[AdapterVersion]) -> dict[uuid.UUID, str]:
    ids = {v.override_by for v in versions if v.override_by is not None}
    if not ids:
        return {}
    return {uid: email for uid, email in db.execute(select(User.id, User.email).where(User.id.in_(ids)))}


# -- tenants ----------------------------------------------------------------------------------------------------
@router.get("/tenants", response_model=ListOf[AdminTenantOut], responses=_ERRORS)
def list_tenants(_: PlatformAdmin, db: SessionDep, gw: GatewayDep):
    """Every tenant with its tokens used and amount billed this UTC month, and how many users it has."""
    tenants = crud.list_tenants(db)
    used = crud.tokens_this_month_by_tenant(db)
    today = datetime.now(timezone.utc).date()
    billed: dict[uuid.UUID, int] = {}
    for r in current_daily_rows(db, BillingConfig.from_settings(gw.settings), day_from=today.replace(day=1),
                                day_to=month_end(today)):
        billed[r.tenant_id] = billed.get(r.tenant_id, 0) + r.billed_micros
    users = dict(db.execute(select(User.tenant_id, func.count()).where(User.tenant_id.is_not(None)).group_by(User.tenant_id)).all())
    return ListOf[AdminTenantOut](data=[admin_tenant_out(t, used.get(t.id, 0), billed.get(t.id, 0), users.get(t.id, 0))
                                        for t in tenants])


@router.post("/tenants", status_code=201, response_model=TenantOut, responses={**_ERRORS, 409: {}})
def create_tenant(body: TenantCreate, user: PlatformAdmin, request: Request, db: SessionDep):
    tenant = crud.create_tenant(db, name=body.name, slug=body.slug, plan=body.plan,
                                limits=body.limits.given() if body.limits else None, actor=actor_of(request, user))
    db.commit()
    return tenant_out(tenant)


@router.patch("/tenants/{tenant_id}", response_model=TenantOut, responses=_ERRORS_404)
def update_tenant(tenant_id: uuid.UUID, body: TenantPatch, user: PlatformAdmin, request: Request, gw: GatewayDep,
                  db: SessionDep):
    """Rename, change plan, suspend/activate, or set limits. Status, plan and limits reach the request path
    at once: the tenant's key-cache entries are dropped after the commit."""
    tenant = crud.update_tenant(db, tenant_id=tenant_id, actor=actor_of(request, user), name=body.name, plan=body.plan,
                                status=body.status, limits=body.limits.given() if body.limits else None)
    hashes = crud.live_key_hashes(db, tenant_id=tenant.id)
    db.commit()
    drop_cached_keys(gw, hashes)
    return tenant_out(tenant)


@router.get("/tenants/{tenant_id}/storage", response_model=StorageOut, responses=_ERRORS_404)
def get_tenant_storage(tenant_id: uuid.UUID, _: PlatformAdmin, db: SessionDep):
    """A tenant's adapter storage: bytes used, its quota and what is left."""
    return storage_out(db, get_tenant(db, tenant_id=tenant_id).id)


@router.put("/tenants/{tenant_id}/storage", response_model=StorageOut, responses=_ERRORS_404)
def set_tenant_storage_quota(tenant_id: uuid.UUID, body: StorageQuotaIn, user: PlatformAdmin, request: Request,
                             db: SessionDep):
    """Give the tenant its own storage quota in bytes (null: back to the platform default). Lowering it under
    the current use removes nothing; only new uploads are refused."""
    crud.set_storage_quota(db, tenant_id=tenant_id, quota_bytes=body.quota_bytes, actor=actor_of(request, user))
    db.commit()
    return storage_out(db, tenant_id)


@router.post("/tenants/{tenant_id}/users", status_code=201, response_model=UserOut, responses={**_ERRORS_404, 409: {}})
def create_user(tenant_id: uuid.UUID, body: UserCreate, user: PlatformAdmin, request: Request, db: SessionDep):
    """A tenant admin or member who signs in to the web app."""
    tenant = get_tenant(db, tenant_id=tenant_id)
    created = crud.create_user(db, email=body.email, password=body.password, role=body.role, tenant_id=tenant.id,
                               actor=actor_of(request, user))
    db.commit()
    return user_out(created, tenant.name)


@router.get("/tenants/{tenant_id}/users", response_model=ListOf[TenantUserOut], responses=_ERRORS_404)
def list_tenant_users(tenant_id: uuid.UUID, _: PlatformAdmin, db: SessionDep):
    """The people who sign in for one tenant (no password hashes, no sessions); 404 for an unknown tenant."""
    tenant = get_tenant(db, tenant_id=tenant_id)
    return ListOf[TenantUserOut](data=[tenant_user_out(u) for u in crud.list_users(db, tenant_id=tenant.id)])


# -- adapters ---------------------------------------------------------------------------------------------------
@router.get("/tenants/{tenant_id}/adapters", response_model=ListOf[AdapterOut], responses=_ERRORS_404)
def list_tenant_adapters(tenant_id: uuid.UUID, _: PlatformAdmin, db: SessionDep):
    """One tenant's live adapters with every version's status and gate results (what the tenant sees at
    /api/tenant/adapters, with overriding admins named). An unknown tenant is a 404, not an empty list."""
    tenant = get_tenant(db, tenant_id=tenant_id)
    items = crud.list_adapters(db, tenant_id=tenant.id)
    names = _override_names(db, [v for item in items for v in item.versions])
    return ListOf[AdapterOut](data=[adapter_out(item, override_names=names) for item in items])


@router.get("/adapters/{adapter_id}", response_model=AdminAdapterOut, responses=_ERRORS_404)
def get_adapter(adapter_id: uuid.UUID, _: PlatformAdmin, db: SessionDep):
    """One live adapter with all its versions and its tenant (the version page's rollback list and way back)."""
    item = crud.get_adapter_with_versions(db, adapter_id=adapter_id)
    tenant = db.get(Tenant, item.adapter.tenant_id)
    out = adapter_out(item, override_names=_override_names(db, item.versions))
    return AdminAdapterOut(**out.model_dump(), tenant_id=tenant.id, tenant_name=tenant.name)


@router.get("/adapter-versions/{version_id}", response_model=VersionOut, responses=_ERRORS_404)
def get_adapter_version(version_id: uuid.UUID, _: PlatformAdmin, db: SessionDep):
    v = crud.get_version(db, version_id=version_id, tenant_id=None)
    return version_out(v, override_by=_override_names(db, [v]).get(v.override_by))


@router.post("/adapter-versions/{version_id}/override", response_model=VersionOut, responses={**_ERRORS_404, 409: {}})
def override_version(version_id: uuid.UUID, body: OverrideIn, user: PlatformAdmin, request: Request, gw: GatewayDep,
                     db: SessionDep):
    """Overrule the quality gate on a decided version, with a recorded reason (audit-logged)."""
    v = crud.override_version(db, version_id=version_id, decision=body.decision, reason=body.reason,
                              actor=actor_of(request, user))
    db.commit()
    _forget_resolutions(gw, v.tenant_id)
    return version_out(v, override_by=user.email)


@router.post("/adapters/{adapter_id}/rollback", response_model=AdapterOut, responses={**_ERRORS_404, 409: {}})
def rollback_adapter(adapter_id: uuid.UUID, body: RollbackIn, user: PlatformAdmin, request: Request, gw: GatewayDep,
                     db: SessionDep):
    """Move the adapter's active pointer to one of its ready versions."""
    item = crud.rollback_adapter(db, adapter_id=adapter_id, version=body.version, actor=actor_of(request, user))
    db.commit()
    _forget_resolutions(gw, item.adapter.tenant_id)
    return adapter_out(item, override_names=_override_names(db, item.versions))


@router.delete("/adapters/{adapter_id}", status_code=204, response_class=Response, responses=_ERRORS_404)
def delete_adapter(adapter_id: uuid.UUID, user: PlatformAdmin, request: Request, gw: GatewayDep, db: SessionDep):
    """Stop routing the adapter (its name becomes unknown); versions and usage stay for billing. Engines
    keep no reference to it, so their caches evict it as other adapters are used."""
    adapter = crud.delete_adapter(db, adapter_id=adapter_id, actor=actor_of(request, user))
    db.commit()
    _forget_resolutions(gw, adapter.tenant_id)
    return Response(status_code=204)
