"""Response shapes of the management API (docs/api.md) and their builders from database rows.

One builder per resource so the tenant and admin routes (and the web app) see identical shapes.
Builders never include secrets: a key's hash and a user's password hash have no field here.
"""
from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from services.common.engine_registry import EngineSnapshot
from services.common.models import AdapterVersion, ApiKey, GateDecision, Tenant, TenantLimits, User
from services.gateway.crud import LIMIT_FIELDS, AdapterWithVersions

T = TypeVar("T")


class ListOf(BaseModel, Generic[T]):
    data: list[T]


class UserOut(BaseModel):
    id: uuid.UUID
    email: str
    role: str
    tenant_id: uuid.UUID | None
    tenant_name: str | None


class SessionOut(BaseModel):
    user: UserOut
    csrf_token: str


class LimitsOut(BaseModel):
    tokens_per_min: int | None = None
    requests_per_min: int | None = None
    concurrent_requests: int | None = None
    monthly_token_budget: int | None = None


class TenantOut(BaseModel):
    id: uuid.UUID
    name: str
    slug: str
    plan: str
    status: str
    limits: LimitsOut


class AdminTenantOut(TenantOut):
    usage_this_month_tokens: int
    billed_this_month_microusd: int  # the same daily rows as statements: what the tenant's page shows as spend
    user_count: int


class TenantUserOut(BaseModel):
    id: uuid.UUID
    email: str
    role: str
    created_at: datetime
    last_login_at: datetime | None
    disabled: bool


class KeyOut(BaseModel):
    id: uuid.UUID
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None  # set on temporary keys only (the playground's)


class CreatedKeyOut(BaseModel):
    id: uuid.UUID
    name: str
    prefix: str
    key: str  # the only time the full key is ever sent
    created_at: datetime


class ProgressOut(BaseModel):
    percent: int
    step: str | None


class ReasonOut(BaseModel):
    code: str
    message: str


class EvalOut(BaseModel):
    passed: bool | None
    metrics: dict[str, Any]
    thresholds: dict[str, Any]
    # Every check of the gate, passed or not: {check, code, passed, message, value, threshold}
    # (the version's own `reasons` hold only what refused it).
    reasons: list[Any] = []
    examples: list[Any]


class StorageOut(BaseModel):
    """A tenant's adapter storage: bytes of the objects its versions keep (each distinct object once), its
    quota (its own, or the platform default) and what is left."""

    used_bytes: int
    quota_bytes: int
    remaining_bytes: int
    quota_is_default: bool


class OverrideOut(BaseModel):
    by: str
    reason: str
    at: datetime


class VersionOut(BaseModel):
    id: uuid.UUID
    adapter_id: uuid.UUID
    adapter_name: str
    version: int
    status: str
    active: bool  # the version the adapter's name routes to now
    progress: ProgressOut
    reasons: list[ReasonOut]
    rank: int | None
    target_modules: list[str] | None
    content_sha256: str
    eval: EvalOut | None
    override: OverrideOut | None
    created_at: datetime
    ready_at: datetime | None


class AdapterOut(BaseModel):
    id: uuid.UUID
    name: str
    active_version: int | None  # the version number `name` routes to; null = not routable
    versions: list[VersionOut]


class AdminAdapterOut(AdapterOut):
    tenant_id: uuid.UUID
    tenant_name: str


class EngineAdapterOut(BaseModel):
    """A content id an engine holds, with the adapter versions it is (one file can back several)."""

    content_id: str
    names: list[str]  # "name@version" of each live version with this content
    tenants: list[str]  # their tenants' names


class EngineHealthOut(BaseModel):
    state: str  # healthy | degraded | unhealthy
    reasons: list[str]


class EngineOut(BaseModel):
    id: str
    url: str
    base_model: str
    running: int
    waiting: int
    kv_usage: float
    slot_adapters: list[str]  # content ids (sha256) in device slots
    host_adapters: list[str]  # content ids cached in host memory
    updated_at: datetime | None
    slots_total: int | None = None  # device adapter slots (max_loras); null from engines that do not say
    adapters: list[EngineAdapterOut] = []  # every content id above, named
    health: EngineHealthOut | None = None


class EngineSampleOut(BaseModel):
    ts: datetime
    tokens_per_s: float | None  # tokens processed per second since the previous sample (null for the first)
    running: int
    waiting: int
    kv_usage: float
    slots_used: int
    slots_total: int | None


class EngineHistoryOut(BaseModel):
    id: str
    samples: list[EngineSampleOut]  # oldest first


def user_out(user: User, tenant_name: str | None) -> UserOut:
    return UserOut(id=user.id, email=user.email, role=str(user.role), tenant_id=user.tenant_id, tenant_name=tenant_name)


def limits_out(row: TenantLimits | None) -> LimitsOut:
    return LimitsOut(**{f: getattr(row, f) for f in LIMIT_FIELDS}) if row is not None else LimitsOut()


def tenant_out(tenant: Tenant) -> TenantOut:
    return TenantOut(id=tenant.id, name=tenant.name, slug=tenant.slug, plan=tenant.plan, status=str(tenant.status),
                     limits=limits_out(tenant.limits))


def admin_tenant_out(tenant: Tenant, tokens_this_month: int, billed_this_month: int, user_count: int) -> AdminTenantOut:
    return AdminTenantOut(**tenant_out(tenant).model_dump(), usage_this_month_tokens=tokens_this_month,
                          billed_this_month_microusd=billed_this_month, user_count=user_count)


def tenant_user_out(user: User) -> TenantUserOut:
    return TenantUserOut(id=user.id, email=user.email, role=str(user.role), created_at=user.created_at,
                         last_login_at=user.last_login_at, disabled=user.disabled_at is not None)


def key_out(row: ApiKey) -> KeyOut:
    return KeyOut(id=row.id, name=row.name, prefix=row.prefix, scopes=list(row.scopes), created_at=row.created_at,
                  last_used_at=row.last_used_at, revoked_at=row.revoked_at, expires_at=row.expires_at)


def _eval_out(v: AdapterVersion) -> EvalOut | None:
    """The gate's verdict: the version's eval summary when the pipeline wrote one, else its latest decided run."""
    summary = v.eval_summary or {}
    run = next((r for r in reversed(v.eval_runs) if r.decision is not None), None)
    if not summary and run is None:
        return None
    passed = summary.get("passed", run.decision == GateDecision.PASS if run is not None else None)
    return EvalOut(
        passed=passed,
        metrics=summary.get("metrics", run.metrics if run is not None else {}),
        thresholds=summary.get("thresholds", v.gate_config or {}),
        reasons=summary.get("reasons", run.reasons if run is not None else []),
        examples=summary.get("examples", run.examples if run is not None else []),
    )


def version_out(v: AdapterVersion, *, override_by: str | None = None) -> VersionOut:
    """`override_by`: how to name the overriding admin (an email for admins; tenants see only the role)."""
    override = None
    if v.override_at is not None:
        override = OverrideOut(by=override_by or "platform admin", reason=v.override_reason or "", at=v.override_at)
    reasons = [ReasonOut(code=str(r.get("code", "")), message=str(r.get("message", "")))
               for r in (v.status_reasons or []) if isinstance(r, dict)]
    return VersionOut(
        id=v.id, adapter_id=v.adapter_id, adapter_name=v.adapter.name, version=v.version, status=str(v.status),
        active=v.adapter.active_version_id == v.id and v.adapter.deleted_at is None, progress=ProgressOut(percent=v.progress_percent, step=v.progress_step), reasons=reasons, rank=v.rank,
        target_modules=list(v.target_modules) if v.target_modules is not None else None,
        content_sha256=v.content_sha256, eval=_eval_out(v), override=override, created_at=v.created_at,
        ready_at=v.ready_at,
    )


def storage_out(db, tenant_id: uuid.UUID) -> StorageOut:
    from services.adapters.config import PipelineConfig
    from services.adapters.quota import quota_bytes, used_bytes
    from services.common.models import TenantLimits

    default = PipelineConfig.from_env().storage_quota_bytes
    quota = quota_bytes(db, tenant_id, default=default)
    own = db.get(TenantLimits, tenant_id)
    used = used_bytes(db, tenant_id)
    return StorageOut(used_bytes=used, quota_bytes=quota, remaining_bytes=max(0, quota - used),
                      quota_is_default=own is None or own.storage_quota_bytes is None)


def adapter_out(item: AdapterWithVersions, *, override_names: dict[uuid.UUID, str] | None = None) -> AdapterOut:
    names = override_names or {}
    active = item.active
    return AdapterOut(
        id=item.adapter.id, name=item.adapter.name, active_version=active.version if active else None,
        versions=[version_out(v, override_by=names.get(v.override_by)) for v in item.versions],
    )


def engine_out(s: EngineSnapshot, *, adapters: list[EngineAdapterOut] | None = None,
               health: EngineHealthOut | None = None) -> EngineOut:
    return EngineOut(
        id=s.id, url=s.url, base_model=s.base_model, running=s.running, waiting=s.waiting, kv_usage=s.kv_usage,
        slot_adapters=list(s.slot_adapters), host_adapters=list(s.host_adapters),
        updated_at=datetime.fromtimestamp(s.ts, tz=timezone.utc) if s.ts is not None else None,
        slots_total=s.slots_total, adapters=adapters or [], health=health,
    )
