"""The web playground's credential (`POST /api/tenant/playground/key`): a temporary API key for the signed-in
tenant user's browser, so the playground calls the real OpenAI API (/v1) like any client would.

Why a key and not the session cookie on /v1: /v1 stays bearer-only, so no cross-site page can make a browser
spend a tenant's money with its cookie (no CSRF surface on the inference path), and usage, quotas and the
ledger treat playground calls exactly like API calls. The key is inference-only, expires after
crud.PLAYGROUND_KEY_TTL, is throttled on its own (crud.PLAYGROUND_KEY_LIMITS, on top of the tenant's limits),
replaces the user's previous playground key, and is revoked when the user signs out. The browser keeps it in
memory only. Tenant members may mint one: they can already read everything the playground shows, and what it
spends counts against the tenant's budget and is listed under "Playground · <email>" on the keys page.
"""
from __future__ import annotations

import uuid
from datetime import datetime

from fastapi import APIRouter, Request
from pydantic import BaseModel

from services.gateway import crud
from services.gateway.api.auth import actor_of, drop_cached_keys
from services.gateway.deps import GatewayDep, SessionDep, TenantUser

router = APIRouter(prefix="/api/tenant", tags=["tenant"])


class PlaygroundLimitsOut(BaseModel):
    requests_per_min: int | None
    concurrent_requests: int | None


class PlaygroundKeyOut(BaseModel):
    id: uuid.UUID
    name: str
    prefix: str
    key: str  # shown this once; the browser keeps it in memory only
    created_at: datetime
    expires_at: datetime
    limits: PlaygroundLimitsOut


@router.post("/playground/key", status_code=201, response_model=PlaygroundKeyOut, responses={401: {}, 403: {}, 409: {}})
def create_playground_key(user: TenantUser, request: Request, gw: GatewayDep, db: SessionDep):
    """A temporary inference key for this user's playground; their previous one stops working."""
    assert user.tenant_id is not None  # tenant roles always carry a tenant
    row, full, revoked = crud.create_playground_key(db, tenant_id=user.tenant_id, user_id=user.user_id, email=user.email,
                                                    actor=actor_of(request, user))
    db.commit()
    drop_cached_keys(gw, revoked)
    return PlaygroundKeyOut(id=row.id, name=row.name, prefix=row.prefix, key=full, created_at=row.created_at,
                            expires_at=row.expires_at, limits=PlaygroundLimitsOut(**{
                                k: crud.PLAYGROUND_KEY_LIMITS.get(k) for k in PlaygroundLimitsOut.model_fields}))
