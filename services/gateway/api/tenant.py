"""The tenant pages' API (roles tenant_member, tenant_admin): the caller's tenant, its API keys, its adapters.

Every query is filtered by the signed-in user's tenant, never by an id from the path or body: another
tenant's key or adapter version is a 404 exactly like a missing one. Usage and spend live in
api/tenant_usage.py (billing).
"""
from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, StringConstraints

from services.common import audit
from services.gateway import crud
from services.gateway.api.auth import actor_of, drop_cached_keys
from services.gateway.api.views import (
    AdapterOut,
    CreatedKeyOut,
    KeyOut,
    ListOf,
    StorageOut,
    TenantOut,
    VersionOut,
    adapter_out,
    key_out,
    storage_out,
    tenant_out,
    version_out,
)
from services.gateway.deps import GatewayDep, SessionDep, TenantAdmin, TenantUser

router = APIRouter(prefix="/api/tenant", tags=["tenant"])

_ERRORS = {401: {}, 403: {}}
_ERRORS_404 = {**_ERRORS, 404: {}}


class KeyCreate(BaseModel):
    name: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=crud.MAX_NAME_LEN)]
    scopes: list[Annotated[str, StringConstraints(max_length=64)]] | None = None  # default: inference only


@router.get("", response_model=TenantOut, responses=_ERRORS)
def get_tenant(user: TenantUser, db: SessionDep):
    """The caller's tenant: plan, status and quota limits (null = unlimited)."""
    return tenant_out(audit.get_tenant(db, tenant_id=user.tenant_id))


@router.get("/storage", response_model=StorageOut, responses=_ERRORS)
def get_storage(user: TenantUser, db: SessionDep):
    """The tenant's adapter storage: bytes used, its quota and what is left (uploads past it are refused, 413)."""
    return storage_out(db, user.tenant_id)


@router.get("/keys", response_model=ListOf[KeyOut], responses=_ERRORS)
def list_keys(user: TenantUser, db: SessionDep):
    """The tenant's API keys, newest first, revoked ones included (secrets are never shown again)."""
    return ListOf[KeyOut](data=[key_out(k) for k in crud.list_api_keys(db, tenant_id=user.tenant_id)])


@router.post("/keys", status_code=201, response_model=CreatedKeyOut, responses={**_ERRORS, 409: {}})
def create_key(body: KeyCreate, user: TenantAdmin, request: Request, db: SessionDep):
    """Create a key (tenant_admin). The full key is in this response only; scopes default to inference."""
    row, full = crud.create_api_key(db, tenant_id=user.tenant_id, name=body.name, scopes=body.scopes,
                                    actor=actor_of(request, user))
    db.commit()
    return CreatedKeyOut(id=row.id, name=row.name, prefix=row.prefix, key=full, created_at=row.created_at)


@router.delete("/keys/{key_id}", status_code=204, response_class=Response, responses=_ERRORS_404)
def revoke_key(key_id: uuid.UUID, user: TenantAdmin, request: Request, gw: GatewayDep, db: SessionDep):
    """Revoke a key (tenant_admin). Takes effect at once on this gateway, within seconds on the others."""
    row = crud.revoke_api_key(db, tenant_id=user.tenant_id, key_id=key_id, actor=actor_of(request, user))
    db.commit()
    drop_cached_keys(gw, [row.key_hash])
    return Response(status_code=204)


@router.get("/adapters", response_model=ListOf[AdapterOut], responses=_ERRORS)
def list_adapters(user: TenantUser, db: SessionDep):
    """The tenant's adapters with every version's status and quality-gate results."""
    return ListOf[AdapterOut](data=[adapter_out(a) for a in crud.list_adapters(db, tenant_id=user.tenant_id)])


@router.get("/adapter-versions/{version_id}", response_model=VersionOut, responses=_ERRORS_404)
def get_adapter_version(version_id: uuid.UUID, user: TenantUser, db: SessionDep):
    """One of the tenant's adapter versions (for polling an upload's progress)."""
    return version_out(crud.get_version(db, version_id=version_id, tenant_id=user.tenant_id))
