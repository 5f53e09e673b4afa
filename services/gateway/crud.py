"""Management actions on tenants, users, API keys and adapters: keyword-only functions the HTTP API and
the `mplex admin` CLI both call, so both enforce the same rules and write the same audit rows.

Functions flush but never commit: the caller's unit of work (a request, `session_scope()`) commits the
change together with its audit row, or neither. Tenant-scoped functions take the caller's `tenant_id`
and treat another tenant's id exactly like a missing one (NotFoundError), so existence never leaks.
Errors are the API's typed errors (services.common.errors); the CLI prints their message.
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from services.common.audit import Actor, get_tenant, record_audit
from services.common.errors import ConflictError, InvalidRequestError, NotFoundError
from services.common.keys import ALL_SCOPES, DEFAULT_SCOPES, SCOPE_INFERENCE, generate_key
from services.common.models import (
    SLUG_PATTERN,
    Adapter,
    AdapterStatus,
    AdapterVersion,
    ApiKey,
    Role,
    Tenant,
    TenantLimits,
    TenantStatus,
    UsageEvent,
    User,
)
from services.common.passwords import WeakPassword, hash_password
from services.gateway.usage_queries import month_start

# The quota windows a tenant (or key) can have, with the largest value its column holds. None = unlimited.
LIMIT_FIELDS: dict[str, int] = {
    "tokens_per_min": 2**63 - 1,
    "requests_per_min": 2**31 - 1,
    "concurrent_requests": 2**31 - 1,
    "monthly_token_budget": 2**63 - 1,
}
# What a new tenant gets for every window its creator does not set: finite, so that a tenant nobody thought
# about cannot take a whole engine (a demo engine runs a few dozen sequences at once). Unlimited (None) must
# be asked for explicitly. Sized like a starter plan; see docs/gateway.md ("Limits of a new tenant").
NEW_TENANT_LIMITS: dict[str, int] = {
    "tokens_per_min": 100_000,
    "requests_per_min": 300,
    "concurrent_requests": 16,
    "monthly_token_budget": 10_000_000,
}
MAX_LIVE_KEYS_PER_TENANT = 200  # a runaway script creating keys is a bug to stop, not a workload
MAX_NAME_LEN = 200
_SLUG_RE = re.compile(SLUG_PATTERN)
_EMAIL_RE = re.compile(r"^[^@\s]{1,64}@[^@\s]{1,190}$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _clean_name(value: str, what: str) -> str:
    value = (value or "").strip()
    if not value or len(value) > MAX_NAME_LEN or _CONTROL_RE.search(value):
        raise InvalidRequestError(f"{what} must be 1-{MAX_NAME_LEN} printable characters", param=what)
    return value


def check_limits(limits: dict[str, int | None]) -> dict[str, int | None]:
    """Known windows only, each None (unlimited) or an integer in the column's range."""
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown limit(s): {', '.join(sorted(unknown))}", param="limits")
    for name, value in limits.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= LIMIT_FIELDS[name]:
            raise InvalidRequestError(f"limits.{name} must be null or an integer from 0 to {LIMIT_FIELDS[name]}",
                                      param=f"limits.{name}")
    return dict(limits)


# -- tenants --------------------------------------------------------------------------------------------------
def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).options(selectinload(Tenant.limits)).order_by(Tenant.created_at, Tenant.id)))


def tokens_this_month_by_tenant(session: Session) -> dict[uuid.UUID, int]:
    """Prompt + completion tokens per tenant in the ledger since the start of this UTC month."""
    q = (select(UsageEvent.tenant_id, func.sum(UsageEvent.prompt_tokens + UsageEvent.completion_tokens))
         .where(UsageEvent.created_at >= month_start()).group_by(UsageEvent.tenant_id))
    return {tid: int(total) for tid, total in session.execute(q)}


def create_tenant(
    session: Session, *, name: str, slug: str, plan: str = "default", limits: dict[str, int | None] | None = None,
    actor: Actor,
) -> Tenant:
    """`limits`: the windows to set; each one left out gets NEW_TENANT_LIMITS, None makes it unlimited."""
    name, plan = _clean_name(name, "name"), _clean_name(plan, "plan")
    if not isinstance(slug, str) or not _SLUG_RE.fullmatch(slug):
        raise InvalidRequestError("slug must be 2-63 characters of a-z, 0-9 and '-', starting with a letter or digit",
                                  param="slug")
    limits = {**NEW_TENANT_LIMITS, **check_limits(limits or {})}  # a window given (even as None) wins
    if session.scalar(select(Tenant.id).where(Tenant.slug == slug)) is not None:
        raise ConflictError(f"A tenant with slug {slug!r} already exists.", param="slug", code="slug_taken")
    tenant = Tenant(name=name, slug=slug, plan=plan, status=TenantStatus.ACTIVE)
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError:  # a concurrent create won the slug
        session.rollback()
        raise ConflictError(f"A tenant with slug {slug!r} already exists.", param="slug", code="slug_taken") from None
    session.add(TenantLimits(tenant_id=tenant.id, **limits))
    session.flush()
    session.refresh(tenant, ["limits"])
    record_audit(session, actor=actor, action="tenant.create", tenant_id=tenant.id, target_type="tenant",
                 target_id=tenant.id, details={"slug": slug, "plan": plan, "limits": limits})
    return tenant


MAX_STORAGE_QUOTA_BYTES = 2**63 - 1


def set_storage_quota(session: Session, *, tenant_id: uuid.UUID, quota_bytes: int | None, actor: Actor) -> Tenant:
    """The tenant's own adapter storage quota in bytes; None returns it to the platform default."""
    if quota_bytes is not None and (isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int)
                                    or not 0 <= quota_bytes <= MAX_STORAGE_QUOTA_BYTES):
        raise InvalidRequestError("quota_bytes must be null (the platform default) or a non-negative integer",
                                  param="quota_bytes")
    tenant = get_tenant(session, tenant_id=tenant_id, for_update=True)
    row = tenant.limits
    if row is None:
        row = TenantLimits(tenant_id=tenant.id)
        session.add(row)
    before = row.storage_quota_bytes
    row.storage_quota_bytes = quota_bytes
    session.flush()
    record_audit(session, actor=actor, action="tenant.storage_quota", tenant_id=tenant.id, target_type="tenant",
                 target_id=tenant.id, details={"before": before, "after": quota_bytes})
    return tenant


def set_limits(session: Session, *, tenant_id: uuid.UUID, limits: dict[str, int | None], actor: Actor) -> Tenant:
    """Change the given windows only (a missing field keeps its value; None makes it unlimited)."""
    limits = check_limits(limits)
    tenant = get_tenant(session, tenant_id=tenant_id, for_update=True)
    row = tenant.limits
    if row is None:
        row = TenantLimits(tenant_id=tenant.id)
        session.add(row)
    before = {f: getattr(row, f, None) for f in LIMIT_FIELDS}
    for name, value in limits.items():
        setattr(row, name, value)
    session.flush()
    session.refresh(tenant, ["limits"])
    record_audit(session, actor=actor, action="tenant.limits", tenant_id=tenant.id, target_type="tenant",
                 target_id=tenant.id, details={"before": before, "after": {f: getattr(row, f) for f in LIMIT_FIELDS}})
    return tenant


def set_status(session: Session, *, tenant_id: uuid.UUID, status: TenantStatus | str, actor: Actor) -> Tenant:
    try:
        status = TenantStatus(status)
    except ValueError:
        raise InvalidRequestError("status must be 'active' or 'suspended'", param="status") from None
    tenant = get_tenant(session, tenant_id=tenant_id, for_update=True)
    if tenant.status != status:
        before = tenant.status
        tenant.status = status
        session.flush()
        action = "tenant.suspend" if status == TenantStatus.SUSPENDED else "tenant.activate"
        record_audit(session, actor=actor, action=action, tenant_id=tenant.id, target_type="tenant", target_id=tenant.id,
                     details={"before": str(before), "after": str(status)})
    return tenant


def update_tenant(
    session: Session, *, tenant_id: uuid.UUID, actor: Actor, name: str | None = None, plan: str | None = None,
    status: str | None = None, limits: dict[str, int | None] | None = None,
) -> Tenant:
    """PATCH semantics: only the given fields change. Each kind of change gets its own audit row."""
    tenant = get_tenant(session, tenant_id=tenant_id, for_update=True)
    changed = {}
    for attr, value in (("name", name), ("plan", plan)):
        if value is None:
            continue
        value = _clean_name(value, attr)
        if value != getattr(tenant, attr):
            changed[attr] = {"before": getattr(tenant, attr), "after": value}
            setattr(tenant, attr, value)
    if changed:
        session.flush()
        record_audit(session, actor=actor, action="tenant.update", tenant_id=tenant.id, target_type="tenant",
                     target_id=tenant.id, details=changed)
    if limits:
        set_limits(session, tenant_id=tenant.id, limits=limits, actor=actor)
    if status is not None:
        set_status(session, tenant_id=tenant.id, status=status, actor=actor)
    session.refresh(tenant)
    return tenant


def live_key_hashes(session: Session, *, tenant_id: uuid.UUID) -> list[str]:
    """Hashes of the tenant's unrevoked keys: their key-cache entries embed the tenant's status, plan and
    limits, so a change to those must drop them (a revoked key's entry says only "invalid")."""
    return list(session.scalars(select(ApiKey.key_hash).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))))


# -- users ----------------------------------------------------------------------------------------------------
def normalize_email(email: str) -> str:
    email = (email or "").strip().lower()
    if len(email) > 254 or not _EMAIL_RE.fullmatch(email) or _CONTROL_RE.search(email):
        raise InvalidRequestError("email is not a valid address", param="email")
    return email


def create_user(
    session: Session, *, email: str, password: str, role: Role | str, tenant_id: uuid.UUID | None = None,
    display_name: str | None = None, actor: Actor,
) -> User:
    """Tenant roles need a tenant; platform roles (platform_admin, finance) must not have one."""
    try:
        role = Role(role)
    except ValueError:
        raise InvalidRequestError(f"role must be one of {', '.join(r.value for r in Role)}", param="role") from None
    email = normalize_email(email)
    if role.is_tenant_role and tenant_id is None:
        raise InvalidRequestError(f"a {role} belongs to a tenant", param="role")
    if not role.is_tenant_role and tenant_id is not None:
        raise InvalidRequestError(f"a {role} is platform-wide and cannot belong to a tenant", param="role")
    if tenant_id is not None:
        get_tenant(session, tenant_id=tenant_id)
    try:
        password_hash = hash_password(password)
    except WeakPassword as exc:
        raise InvalidRequestError(str(exc), param="password") from None
    if session.scalar(select(User.id).where(User.email == email)) is not None:
        raise ConflictError("A user with this email already exists.", param="email", code="email_taken")
    user = User(email=email, password_hash=password_hash, role=role, tenant_id=tenant_id,
                display_name=_clean_name(display_name, "display_name") if display_name else None)
    session.add(user)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise ConflictError("A user with this email already exists.", param="email", code="email_taken") from None
    record_audit(session, actor=actor, action="user.create", tenant_id=tenant_id, target_type="user", target_id=user.id,
                 details={"email": email, "role": str(role)})
    return user


def list_users(session: Session, *, tenant_id: uuid.UUID) -> list[User]:
    return list(session.scalars(select(User).where(User.tenant_id == tenant_id).order_by(User.email)))


# -- API keys -------------------------------------------------------------------------------------------------
def create_api_key(
    session: Session, *, tenant_id: uuid.UUID, name: str, actor: Actor, scopes: Iterable[str] | None = None,
    limits: dict[str, int | None] | None = None,
) -> tuple[ApiKey, str]:
    """Returns the row and the full key; the full key exists only in this return value (only its hash is stored)."""
    name = _clean_name(name, "name")
    scopes = list(dict.fromkeys(scopes if scopes is not None else DEFAULT_SCOPES))
    if not scopes or set(scopes) - ALL_SCOPES:
        raise InvalidRequestError(f"scopes must be a non-empty subset of {', '.join(sorted(ALL_SCOPES))}", param="scopes")
    limits = check_limits(limits or {})
    tenant = get_tenant(session, tenant_id=tenant_id, for_update=True)  # serializes the live-key count check
    live = session.scalar(select(func.count()).where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None)))
    if live >= MAX_LIVE_KEYS_PER_TENANT:
        raise ConflictError(f"This tenant already has {live} active keys; revoke unused ones first.", code="too_many_keys")
    new = generate_key()
    row = ApiKey(tenant_id=tenant.id, prefix=new.prefix, key_hash=new.hash, name=name, scopes=scopes,
                 created_by=actor.user_id, **limits)
    session.add(row)
    session.flush()
    record_audit(session, actor=actor, action="key.create", tenant_id=tenant.id, target_type="api_key", target_id=row.id,
                 details={"name": name, "prefix": new.prefix, "scopes": scopes})
    return row, new.full


# The web playground's temporary keys: inference only, short-lived, throttled on their own, one live per user.
PLAYGROUND_KEY_NAME = "Playground · "
PLAYGROUND_KEY_TTL = timedelta(minutes=30)
PLAYGROUND_KEY_LIMITS = {"requests_per_min": 30, "concurrent_requests": 2}


def revoke_playground_keys(session: Session, *, tenant_id: uuid.UUID, user_id: uuid.UUID) -> list[str]:
    """Revoke the user's live playground keys and the tenant's expired ones (so they stop counting as live);
    returns their hashes, whose cache entries the caller drops after committing."""
    now = datetime.now(timezone.utc)
    rows = session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None), ApiKey.expires_at.is_not(None),
                             ApiKey.name.startswith(PLAYGROUND_KEY_NAME, autoescape=True))
        .with_for_update()
    ).all()
    revoked = [k for k in rows if k.created_by == user_id or k.expires_at <= now]
    for k in revoked:
        k.revoked_at = now
    session.flush()
    return [k.key_hash for k in revoked]


def create_playground_key(session: Session, *, tenant_id: uuid.UUID, user_id: uuid.UUID, email: str,
                          actor: Actor) -> tuple[ApiKey, str, list[str]]:
    """A temporary inference key for the signed-in user's browser, replacing their previous one. Returns the
    row, the full key (this once) and the hashes of the keys it revoked."""
    revoked = revoke_playground_keys(session, tenant_id=tenant_id, user_id=user_id)
    name = (PLAYGROUND_KEY_NAME + email)[:MAX_NAME_LEN]
    row, full = create_api_key(session, tenant_id=tenant_id, name=name, actor=actor, scopes=[SCOPE_INFERENCE],
                               limits=PLAYGROUND_KEY_LIMITS)
    row.expires_at = datetime.now(timezone.utc) + PLAYGROUND_KEY_TTL
    session.flush()
    return row, full, revoked


def list_api_keys(session: Session, *, tenant_id: uuid.UUID) -> list[ApiKey]:
    return list(session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at.desc(), ApiKey.id.desc())
    ))


def get_api_key(session: Session, *, tenant_id: uuid.UUID, key_id: uuid.UUID, for_update: bool = False) -> ApiKey:
    q = select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id)
    row = session.scalar(q.with_for_update() if for_update else q)
    if row is None:
        raise NotFoundError("API key not found.")
    return row


def revoke_api_key(session: Session, *, tenant_id: uuid.UUID, key_id: uuid.UUID, actor: Actor) -> ApiKey:
    """Idempotent: revoking a revoked key keeps its first revocation time. The caller must drop the key's
    cache entry after committing (KeyAuth.forget), else it keeps working for up to the key-cache TTL."""
    row = get_api_key(session, tenant_id=tenant_id, key_id=key_id, for_update=True)
    if row.revoked_at is None:
        row.revoked_at = datetime.now(timezone.utc)
        session.flush()
        record_audit(session, actor=actor, action="key.revoke", tenant_id=tenant_id, target_type="api_key",
                     target_id=row.id, details={"name": row.name, "prefix": row.prefix})
    return row


# -- adapters -------------------------------------------------------------------------------------------------
def _version_query():
    return select(AdapterVersion).join(Adapter, Adapter.id == AdapterVersion.adapter_id).options(
        selectinload(AdapterVersion.adapter), selectinload(AdapterVersion.eval_runs)
    )


def get_version(session: Session, *, version_id: uuid.UUID, tenant_id: uuid.UUID | None) -> AdapterVersion:
    """`tenant_id` = the caller's tenant (a deleted adapter's versions are gone for it); None = platform scope."""
    q = _version_query().where(AdapterVersion.id == version_id)
    if tenant_id is not None:
        q = q.where(AdapterVersion.tenant_id == tenant_id, Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None))
    row = session.scalar(q)
    if row is None:
        raise NotFoundError("Adapter version not found.")
    return row


@dataclass(frozen=True, slots=True)
class AdapterWithVersions:
    adapter: Adapter
    versions: list[AdapterVersion]  # by version number, each with its eval runs loaded

    @property
    def active(self) -> AdapterVersion | None:
        return next((v for v in self.versions if v.id == self.adapter.active_version_id), None)


def list_adapters(session: Session, *, tenant_id: uuid.UUID) -> list[AdapterWithVersions]:
    """The tenant's live adapters with all their versions (and eval runs), in three queries."""
    adapters = list(session.scalars(
        select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None)).order_by(Adapter.name)
    ))
    versions = session.scalars(
        _version_query().where(AdapterVersion.tenant_id == tenant_id, Adapter.deleted_at.is_(None))
        .order_by(AdapterVersion.version)
    ).all()
    by_adapter: dict[uuid.UUID, list[AdapterVersion]] = {}
    for v in versions:
        by_adapter.setdefault(v.adapter_id, []).append(v)
    return [AdapterWithVersions(a, by_adapter.get(a.id, [])) for a in adapters]


def get_adapter(session: Session, *, adapter_id: uuid.UUID, for_update: bool = False) -> Adapter:
    """Platform scope: a live adapter of any tenant (deleted ones are gone)."""
    q = select(Adapter).where(Adapter.id == adapter_id, Adapter.deleted_at.is_(None))
    row = session.scalar(q.with_for_update() if for_update else q)
    if row is None:
        raise NotFoundError("Adapter not found.")
    return row


def get_adapter_with_versions(session: Session, *, adapter_id: uuid.UUID) -> AdapterWithVersions:
    """Platform scope: a live adapter of any tenant with all its versions."""
    adapter = get_adapter(session, adapter_id=adapter_id)
    return AdapterWithVersions(adapter, _versions_of(session, adapter))


def _versions_of(session: Session, adapter: Adapter) -> list[AdapterVersion]:
    return list(session.scalars(
        _version_query().where(AdapterVersion.adapter_id == adapter.id).order_by(AdapterVersion.version)
    ))


def _newest_ready(versions: list[AdapterVersion], exclude: uuid.UUID | None = None) -> AdapterVersion | None:
    ready = [v for v in versions if v.status == AdapterStatus.READY and v.id != exclude]
    return max(ready, key=lambda v: v.version, default=None)


def override_version(
    session: Session, *, version_id: uuid.UUID, decision: AdapterStatus | str, reason: str, actor: Actor,
) -> AdapterVersion:
    """A platform admin overrules the quality gate: a final version becomes ready or rejected, with the
    reason recorded on the version and in the audit log. A version still in the pipeline cannot be
    overridden (its worker would overwrite the decision). The active pointer follows: a version made ready
    becomes active if it is newer than the active one; rejecting the active version falls back to the
    newest other ready version (or none)."""
    try:
        decision = AdapterStatus(decision)
    except ValueError:
        decision = None
    if decision not in (AdapterStatus.READY, AdapterStatus.REJECTED):
        raise InvalidRequestError("decision must be 'ready' or 'rejected'", param="decision")
    reason = (reason or "").strip()
    if not reason or len(reason) > 2000 or "\x00" in reason:
        raise InvalidRequestError("an override needs a reason (1-2000 characters)", param="reason")
    probe = get_version(session, version_id=version_id, tenant_id=None)
    adapter = session.get(Adapter, probe.adapter_id, with_for_update=True)  # serializes pointer moves per adapter
    version = session.get(AdapterVersion, version_id, with_for_update=True, populate_existing=True)
    if not version.status.is_final:
        raise ConflictError(f"The version is still {version.status}; override it once the gate has decided.",
                            code="version_not_final")
    if version.status == decision:
        raise ConflictError(f"The version is already {decision}.", code="already_in_state")
    if decision == AdapterStatus.READY and version.objects_purged_at is not None:
        raise ConflictError("The version's files were removed after its retention period; upload it again.",
                            code="files_removed")
    now = datetime.now(timezone.utc)
    before = version.status
    version.status = decision
    version.override_by, version.override_reason, version.override_at = actor.user_id, reason, now
    if decision == AdapterStatus.READY:
        version.ready_at = version.ready_at or now
    else:
        version.status_reasons = [*version.status_reasons, {"code": "admin_override", "message": reason}]
    session.flush()
    versions = _versions_of(session, adapter)
    active = next((v for v in versions if v.id == adapter.active_version_id), None)
    pointer_before = active.version if active else None
    if decision == AdapterStatus.READY and (active is None or version.version > active.version):
        adapter.active_version_id = version.id
    elif decision == AdapterStatus.REJECTED and adapter.active_version_id == version.id:
        fallback = _newest_ready(versions, exclude=version.id)
        adapter.active_version_id = fallback.id if fallback else None
    session.flush()
    pointer_after = next((v.version for v in versions if v.id == adapter.active_version_id), None)
    record_audit(session, actor=actor, action="adapter.override", tenant_id=adapter.tenant_id,
                 target_type="adapter_version", target_id=version.id,
                 details={"adapter": adapter.name, "version": version.version, "before": str(before),
                          "after": str(decision), "reason": reason, "active_version": {"before": pointer_before,
                                                                                        "after": pointer_after}})
    return get_version(session, version_id=version.id, tenant_id=None)


def rollback_adapter(session: Session, *, adapter_id: uuid.UUID, version: int, actor: Actor) -> AdapterWithVersions:
    """Point the adapter's name at another of its ready versions (any number, older or newer)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidRequestError("version must be a positive integer", param="version")
    adapter = get_adapter(session, adapter_id=adapter_id, for_update=True)
    versions = _versions_of(session, adapter)
    target = next((v for v in versions if v.version == version), None)
    if target is None:
        raise NotFoundError(f"Adapter {adapter.name!r} has no version {version}.", param="version")
    if target.status != AdapterStatus.READY:
        raise ConflictError(f"Version {version} is {target.status}; only a ready version can be active.",
                            param="version", code="version_not_ready")
    before = next((v.version for v in versions if v.id == adapter.active_version_id), None)
    adapter.active_version_id = target.id
    session.flush()
    record_audit(session, actor=actor, action="adapter.rollback", tenant_id=adapter.tenant_id, target_type="adapter",
                 target_id=adapter.id, details={"adapter": adapter.name, "before": before, "after": version})
    return AdapterWithVersions(adapter, versions)


def delete_adapter(session: Session, *, adapter_id: uuid.UUID, actor: Actor) -> Adapter:
    """Stops routing (the name resolves like a missing one); versions and usage stay for billing, and the
    name can be reused by a new adapter."""
    adapter = get_adapter(session, adapter_id=adapter_id, for_update=True)
    adapter.deleted_at = datetime.now(timezone.utc)
    session.flush()
    record_audit(session, actor=actor, action="adapter.delete", tenant_id=adapter.tenant_id, target_type="adapter",
                 target_id=adapter.id, details={"adapter": adapter.name})
    return adapter
