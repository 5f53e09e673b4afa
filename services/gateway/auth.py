"""Who is calling: API keys for the OpenAI API (Redis-cached), cookie sessions for the web app.

Keys: the checksum rejects garbage without a database hit; the full key is only ever compared as a
sha256, in constant time; a verified key is cached for `key_cache_ttl_s`, which bounds how long a
revoked key keeps working. Keys never reach logs (only their public prefix).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from services.common.errors import AuthenticationError, PermissionDeniedError
from services.common.keys import InvalidKeyFormat, hash_secret, parse_key, tenant_cache_salt, verify_key
from services.common.models import ApiKey, Tenant, TenantLimits, TenantStatus, User, WebSession
from services.gateway.quotas import Limits, Scope

log = logging.getLogger("mplex.gateway.auth")

SESSION_COOKIE = "mplex_session"
CSRF_HEADER = "x-csrf-token"
KEY_ROLE = "api_key"  # the role of a SessionPrincipal that is an API key (not a user)


@dataclass(frozen=True, slots=True)
class KeyPrincipal:
    key_id: uuid.UUID
    key_prefix: str
    tenant_id: uuid.UUID
    tenant_slug: str
    plan: str
    scopes: tuple[str, ...]
    tenant_limits: Limits
    key_limits: Limits
    cache_salt: str  # derived server-side from the secret key and the tenant id; never client-controlled
    suspended: bool = False
    # Derived once per principal (which the key cache keeps for its TTL), not once or more per request.
    tenant: str = field(init=False, repr=False, compare=False)  # str(tenant_id): log fields, wire, router, scopes
    _scopes: tuple[Scope, Scope] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tenant = str(self.tenant_id)
        object.__setattr__(self, "tenant", tenant)
        object.__setattr__(self, "_scopes", (Scope("tenant", tenant, self.tenant_limits),
                                             Scope("key", str(self.key_id), self.key_limits)))

    def quota_scopes(self) -> list[Scope]:
        return list(self._scopes)

    def to_json(self) -> bytes:
        return orjson.dumps({
            "key_id": str(self.key_id), "key_prefix": self.key_prefix, "tenant_id": str(self.tenant_id),
            "tenant_slug": self.tenant_slug, "plan": self.plan, "scopes": list(self.scopes),
            "tenant_limits": _limits_dict(self.tenant_limits), "key_limits": _limits_dict(self.key_limits),
            "cache_salt": self.cache_salt, "suspended": self.suspended,
        })

    @classmethod
    def from_json(cls, raw: bytes) -> "KeyPrincipal":
        d = orjson.loads(raw)
        return cls(uuid.UUID(d["key_id"]), d["key_prefix"], uuid.UUID(d["tenant_id"]), d["tenant_slug"], d["plan"],
                   tuple(d["scopes"]), Limits(**d["tenant_limits"]), Limits(**d["key_limits"]), d["cache_salt"],
                   d["suspended"])


def _limits_dict(limits: Limits) -> dict:
    return {"tokens_per_min": limits.tokens_per_min, "requests_per_min": limits.requests_per_min,
            "concurrent": limits.concurrent, "monthly_tokens": limits.monthly_tokens}


def _limits(row) -> Limits:
    if row is None:
        return Limits()
    return Limits(row.tokens_per_min, row.requests_per_min, row.concurrent_requests, row.monthly_token_budget)


_INVALID = b"-"  # negative cache entry: a well-formed key that does not exist or was revoked


class KeyAuth:
    """Verified keys are cached in Redis for `ttl_s` (shared by every gateway) and in-process for
    LOCAL_TTL_S on top. An in-process entry past LOCAL_TTL_S is still used for up to LOCAL_STALE_S more while
    one fetch renews it in the background, so a Redis that answers late never holds a key's requests (under
    overload, refusals that must be quick); a revoked key stops working within ttl_s + LOCAL_TTL_S (plus the
    renewal's own time, at most LOCAL_STALE_S) everywhere, and at once through the gateway that revoked it."""

    LOCAL_TTL_S = 1.0
    LOCAL_STALE_S = 2.0

    def __init__(self, redis: aioredis.Redis, session_factory: sessionmaker[Session], secret_key: str, ttl_s: float):
        self.redis = redis
        self.session_factory = session_factory
        self.secret_key = secret_key
        self.ttl_ms = int(ttl_s * 1000)
        self._local: dict[str, tuple[float, KeyPrincipal]] = {}
        self._touched: dict[uuid.UUID, float] = {}
        self._fetching: dict[str, asyncio.Task] = {}  # cache key -> the fetch in flight (see _fetch_started)
        self._touching: set[asyncio.Task] = set()  # last-use writes under way (held: the loop keeps weak refs)

    async def authenticate(self, authorization: str | None) -> KeyPrincipal:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthenticationError(
                "You didn't provide an API key. Send it as 'Authorization: Bearer mpx_…'.", code="missing_api_key"
            )
        token = authorization[7:].strip()
        try:
            parsed = parse_key(token)
        except InvalidKeyFormat:
            raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key") from None
        cache_key = f"kc:{hash_secret(parsed.full)}"
        local = self._local.get(cache_key)
        now = time.monotonic()
        if local is not None and local[0] + self.LOCAL_STALE_S > now:
            if local[0] <= now:
                self._fetch_started(cache_key, parsed)  # renewed in the background; this request goes on
            principal = local[1]
        else:
            principal = await asyncio.shield(self._fetch_started(cache_key, parsed))
        if principal is None:
            raise AuthenticationError(f"Incorrect API key provided: mpx_{parsed.prefix}_***.", code="invalid_api_key")
        if principal.suspended:
            raise PermissionDeniedError("This tenant is suspended; contact your administrator.", code="tenant_suspended")
        self._touch(principal.key_id)
        return principal

    def _fetch_started(self, cache_key: str, parsed) -> asyncio.Task:
        """The key's fetch from Redis or the database (its result None: no such key), one per key at a time:
        concurrent requests with the same key wait on the one in flight. A tenant's burst of 300 requests on a
        cold cache would otherwise run 300 identical Redis reads and database queries, and every other tenant's
        first request would queue behind them in the thread pool. The fetch is its own task, so a caller that
        hangs up never cancels it for the others; it stores its principal in the in-process cache."""
        task = self._fetching.get(cache_key)
        if task is None:
            task = self._fetching[cache_key] = asyncio.create_task(self._renew(cache_key, parsed))
            task.add_done_callback(lambda t: self._fetched(cache_key, t))
        return task

    def _fetched(self, cache_key: str, task: asyncio.Task) -> None:
        self._fetching.pop(cache_key, None)
        if not task.cancelled():
            task.exception()  # a failed renewal is retried by the next request; the waiting ones saw its error

    async def _renew(self, cache_key: str, parsed) -> KeyPrincipal | None:
        principal = await self._fetch(cache_key, parsed)
        if principal is None:
            self._local.pop(cache_key, None)
            return None
        if len(self._local) > 50_000:
            self._local.clear()
        self._local[cache_key] = (time.monotonic() + min(self.LOCAL_TTL_S, self.ttl_ms / 1000), principal)
        return principal

    async def _fetch(self, cache_key: str, parsed) -> KeyPrincipal | None:
        cached = None
        try:
            cached = await self.redis.get(cache_key)
        except (RedisError, OSError):
            pass  # authentication does not need Redis; the database answers
        if cached == _INVALID:
            return None
        if cached:
            return KeyPrincipal.from_json(cached)
        principal = await asyncio.to_thread(self._lookup, parsed)
        try:
            await self.redis.set(cache_key, principal.to_json() if principal else _INVALID, px=self.ttl_ms)
        except (RedisError, OSError):
            pass
        return principal

    def _lookup(self, parsed) -> KeyPrincipal | None:
        now = datetime.now(timezone.utc)
        with self.session_factory() as s:
            row = s.execute(
                select(ApiKey, Tenant, TenantLimits)
                .join(Tenant, Tenant.id == ApiKey.tenant_id)
                .outerjoin(TenantLimits, TenantLimits.tenant_id == Tenant.id)
                .where(ApiKey.prefix == parsed.prefix)
            ).first()
        if row is None:
            return None
        key, tenant, tlimits = row
        if not verify_key(parsed, key.key_hash) or key.revoked_at is not None or (key.expires_at and key.expires_at <= now):
            return None
        return KeyPrincipal(key.id, key.prefix, tenant.id, tenant.slug, tenant.plan, tuple(key.scopes), _limits(tlimits),
                            _limits(key), tenant_cache_salt(self.secret_key, tenant.id),
                            suspended=tenant.status != TenantStatus.ACTIVE)

    def _touch(self, key_id: uuid.UUID) -> None:
        """Record last use, at most once a minute per key, off the request's path (the hot path must not wait
        on Redis or write Postgres)."""
        now = time.monotonic()
        if self._touched.get(key_id, 0.0) > now:
            return
        if len(self._touched) > 50_000:
            self._touched.clear()
        self._touched[key_id] = now + 60
        task = asyncio.create_task(self._record_use(key_id))
        self._touching.add(task)
        task.add_done_callback(self._touching.discard)

    async def _record_use(self, key_id: uuid.UUID) -> None:
        try:
            first = await self.redis.set(f"kl:{key_id}", 1, nx=True, ex=60)
        except (RedisError, OSError):
            return
        if first:
            task = asyncio.get_running_loop().run_in_executor(None, self._write_last_used, key_id)
            task.add_done_callback(lambda f: f.exception() and log.warning("last_used_at update failed: %s", f.exception()))

    def _write_last_used(self, key_id: uuid.UUID) -> None:
        with self.session_factory() as s:
            s.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=datetime.now(timezone.utc)))
            s.commit()

    async def forget(self, full_key_hash: str) -> None:
        """Drop a key's cache entry now (revocation through this gateway takes effect at once)."""
        self._local.pop(f"kc:{full_key_hash}", None)
        try:
            await self.redis.delete(f"kc:{full_key_hash}")
        except (RedisError, OSError):
            pass


# -- web sessions ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SessionPrincipal:
    """Who calls the management API: a signed-in user, or (on the few routes a key scope opens, see
    services.gateway.deps.session_or_key) an API key of a tenant, with `key_id` set and no user."""

    user_id: uuid.UUID | None
    email: str
    role: str
    tenant_id: uuid.UUID | None
    session_id: str
    key_id: uuid.UUID | None = None

    @classmethod
    def of_key(cls, key: KeyPrincipal) -> SessionPrincipal:
        return cls(None, "", KEY_ROLE, key.tenant_id, "", key.key_id)


def _csrf_for(secret_key: str, token: str) -> str:
    return hmac.new(secret_key.encode(), f"csrf:{token}".encode(), hashlib.sha256).hexdigest()


def create_session(s: Session, user: User, secret_key: str, ttl_s: int, user_agent: str | None, ip: str | None) -> tuple[str, str]:
    """Returns (cookie token, csrf token). Only sha256 hashes of both are stored."""
    token = secrets.token_urlsafe(32)
    csrf = _csrf_for(secret_key, token)
    now = datetime.now(timezone.utc)
    s.add(WebSession(id=hashlib.sha256(token.encode()).hexdigest(), user_id=user.id,
                     csrf_token_hash=hashlib.sha256(csrf.encode()).hexdigest(), expires_at=now + timedelta(seconds=ttl_s),
                     user_agent=(user_agent or "")[:300], ip=ip))
    user.last_login_at = now
    return token, csrf


def load_session(s: Session, token: str | None, secret_key: str) -> tuple[SessionPrincipal, str] | None:
    """The signed-in user for a cookie token, and its CSRF token; None if absent, expired or revoked."""
    if not token or len(token) > 200:
        return None
    row = s.execute(
        select(WebSession, User).join(User, User.id == WebSession.user_id)
        .where(WebSession.id == hashlib.sha256(token.encode()).hexdigest())
    ).first()
    if row is None:
        return None
    ws, user = row
    now = datetime.now(timezone.utc)
    if ws.revoked_at is not None or ws.expires_at <= now or user.disabled_at is not None:
        return None
    return SessionPrincipal(user.id, user.email, str(user.role), user.tenant_id, ws.id), _csrf_for(secret_key, token)


def check_csrf(expected: str, presented: str | None) -> None:
    if not presented or not hmac.compare_digest(expected, presented):
        raise PermissionDeniedError("Missing or invalid CSRF token.", code="csrf_failed")


def revoke_session(s: Session, session_id: str) -> None:
    s.execute(update(WebSession).where(WebSession.id == session_id).values(revoked_at=datetime.now(timezone.utc)))
