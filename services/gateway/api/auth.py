"""Web sign-in: `POST /api/auth/login`, `POST /api/auth/logout`, `GET /api/auth/me` (docs/api.md).

The session cookie is HttpOnly, SameSite=Lax, Path=/, Secure per settings; state-changing calls carry
the CSRF token returned here. Failed sign-ins are counted per (email, client IP) in Redis and locked out
for the rest of a window after LOGIN_MAX_FAILURES, so a password cannot be guessed at argon2 speed.
"""
from __future__ import annotations

import hashlib
import math
from typing import Annotated

import anyio.from_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, StringConstraints
from redis.exceptions import RedisError
from sqlalchemy import select

from services.common.errors import AuthenticationError, RateLimitError, ServiceUnavailableError
from services.common.ids import new_request_id
from services.common.models import Tenant, User
from services.common.passwords import MAX_LENGTH, WeakPassword, hash_password, needs_rehash, verify_password
from services.gateway.auth import CSRF_HEADER, SESSION_COOKIE, SessionPrincipal, check_csrf, create_session, load_session, revoke_session
from services.common.audit import Actor
from services.gateway.crud import revoke_playground_keys
from services.gateway.deps import GatewayDep, SessionDep
from services.gateway.api.views import SessionOut, user_out
from services.gateway.state import Gateway

router = APIRouter(prefix="/api/auth", tags=["auth"])

LOGIN_WINDOW_S = 15 * 60
LOGIN_MAX_FAILURES = 10  # per (email, IP) per window


class LoginIn(BaseModel):
    email: Annotated[str, StringConstraints(min_length=3, max_length=254, pattern=r"^[^\x00-\x1f\x7f]+$")]
    password: Annotated[str, StringConstraints(min_length=1, max_length=MAX_LENGTH)]


def client_ip(request: Request) -> str | None:
    """The peer address (behind a load balancer, run uvicorn with --proxy-headers so this is the client)."""
    return request.client.host if request.client else None


def actor_of(request: Request, user: SessionPrincipal) -> Actor:
    """The audit identity of a signed-in user's request."""
    return Actor(user_id=user.user_id, request_id=new_request_id(), ip=client_ip(request),
                 via="api" if user.key_id is None else f"api_key:{user.key_id}")


def drop_cached_keys(gw: Gateway, key_hashes: list[str]) -> None:
    """Forget keys' cache entries (called from a route's worker thread, after the change is committed), so a
    revocation, suspension or new limit applies at once on this gateway and within the in-process cache
    (KeyAuth.LOCAL_TTL_S) on the others; if Redis is unreachable it still applies within the key-cache TTL."""

    async def forget_all() -> None:
        for h in key_hashes:
            await gw.key_auth.forget(h)

    if key_hashes:
        anyio.from_thread.run(forget_all)


def _failure_key(email: str, ip: str | None) -> str:
    return "lf:" + hashlib.sha256(f"{email}\x00{ip or ''}".encode()).hexdigest()[:40]


def _redis_call(gw: Gateway, fn):
    """Run an async Redis call from this worker thread. Redis down: refuse sign-in (the limiter cannot be
    enforced) unless the deployment chose to fail open."""
    try:
        return anyio.from_thread.run(fn)
    except (RedisError, OSError):
        if gw.settings.redis_fail_open:
            return None
        raise ServiceUnavailableError("Sign-in is unavailable: the rate limiter's store (Redis) is unreachable.",
                                      code="redis_unavailable") from None


def _refuse_if_locked(gw: Gateway, key: str) -> None:
    async def read():
        async with gw.redis.pipeline(transaction=False) as p:
            p.get(key)
            p.pttl(key)
            return await p.execute()

    got = _redis_call(gw, read)
    if got is None:
        return
    count, ttl_ms = got
    if count is not None and int(count) >= LOGIN_MAX_FAILURES:
        retry = max(1, math.ceil(max(ttl_ms, 0) / 1000))
        raise RateLimitError(f"Too many failed sign-ins. Try again in {retry} seconds.", code="too_many_sign_in_attempts",
                             headers={"Retry-After": str(retry)})


def _count_failure(gw: Gateway, key: str) -> None:
    async def incr():
        async with gw.redis.pipeline(transaction=True) as p:
            p.set(key, 0, ex=LOGIN_WINDOW_S, nx=True)  # the window starts at the first failure; INCR keeps the TTL
            p.incr(key)
            await p.execute()

    _redis_call(gw, incr)


def _clear_failures(gw: Gateway, key: str) -> None:
    async def delete():
        await gw.redis.delete(key)

    _redis_call(gw, delete)


def _session_body(db, user: User, csrf: str) -> dict:
    tenant_name = db.scalar(select(Tenant.name).where(Tenant.id == user.tenant_id)) if user.tenant_id else None
    return SessionOut(user=user_out(user, tenant_name), csrf_token=csrf).model_dump(mode="json")


def _cookie_flags(gw: Gateway) -> dict:
    return {"httponly": True, "samesite": "lax", "secure": gw.settings.session_cookie_secure, "path": "/"}


@router.post("/login", response_model=SessionOut, responses={401: {}, 429: {}})
def login(body: LoginIn, request: Request, gw: GatewayDep, db: SessionDep):
    """Sign in with email and password; sets the session cookie and returns the CSRF token."""
    ip = client_ip(request)
    email = body.email.strip().lower()
    limiter = _failure_key(email, ip)
    _refuse_if_locked(gw, limiter)
    user = db.scalar(select(User).where(User.email == email))
    # An unknown email still pays for one argon2 verification, so timing does not tell which emails exist.
    ok = verify_password(user.password_hash if user is not None else None, body.password)
    if not ok or user is None or user.disabled_at is not None:
        _count_failure(gw, limiter)
        raise AuthenticationError("Incorrect email or password.", code="invalid_credentials")
    _clear_failures(gw, limiter)
    if needs_rehash(user.password_hash):
        try:
            user.password_hash = hash_password(body.password)
        except WeakPassword:
            pass  # an old password under today's policy: keep its hash rather than lock the user out
    previous = load_session(db, request.cookies.get(SESSION_COOKIE), gw.settings.secret())
    if previous is not None:  # signing in again replaces this browser's session
        revoke_session(db, previous[0].session_id)
    token, csrf = create_session(db, user, gw.settings.secret(), gw.settings.session_ttl_s,
                                 request.headers.get("user-agent"), ip)
    db.commit()
    response = JSONResponse(_session_body(db, user, csrf))
    response.set_cookie(SESSION_COOKIE, token, max_age=gw.settings.session_ttl_s, **_cookie_flags(gw))
    return response


@router.post("/logout", status_code=204, response_class=Response, responses={403: {}})
def logout(request: Request, gw: GatewayDep, db: SessionDep):
    """Revoke this browser's session (CSRF-checked like every write) and clear the cookie."""
    loaded = load_session(db, request.cookies.get(SESSION_COOKIE), gw.settings.secret())
    if loaded is not None:
        principal, csrf = loaded
        check_csrf(csrf, request.headers.get(CSRF_HEADER))
        revoke_session(db, principal.session_id)
        revoked = []
        if principal.tenant_id is not None:  # the playground's temporary key ends with the sign-out
            revoked = revoke_playground_keys(db, tenant_id=principal.tenant_id, user_id=principal.user_id)
        db.commit()
        drop_cached_keys(gw, revoked)
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, **_cookie_flags(gw))
    return response


@router.get("/me", response_model=SessionOut, responses={401: {}})
def me(request: Request, gw: GatewayDep, db: SessionDep):
    """The signed-in user and the session's CSRF token, or 401."""
    loaded = load_session(db, request.cookies.get(SESSION_COOKIE), gw.settings.secret())
    if loaded is None:
        raise AuthenticationError("Sign in first.", code="not_signed_in")
    principal, csrf = loaded
    return _session_body(db, db.get(User, principal.user_id), csrf)
