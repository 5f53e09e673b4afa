"""A tenant's adapter storage: how many bytes it keeps in the object store, its quota, and the check an upload
passes before anything is written.

Usage counts each distinct object once per tenant — the files of its versions that still keep them (not yet
removed by retention) and their eval sets. An object two tenants share counts for both: each would need it
alone, and a tenant's usage must not reveal what another tenant uploaded.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import func, select, text, union_all
from sqlalchemy.orm import Session

from services.adapters.storage import StoredObject
from services.common.errors import PayloadTooLargeError
from services.common.models import AdapterVersion, TenantLimits


@dataclass(frozen=True, slots=True)
class StorageUsage:
    tenant_id: uuid.UUID
    used_bytes: int
    quota_bytes: int

    @property
    def remaining_bytes(self) -> int:
        return max(0, self.quota_bytes - self.used_bytes)

    def as_dict(self) -> dict:
        return {"used_bytes": self.used_bytes, "quota_bytes": self.quota_bytes, "remaining_bytes": self.remaining_bytes}


class StorageQuotaExceeded(PayloadTooLargeError):
    default_code = "storage_quota_exceeded"


def _kept(tenant_id: uuid.UUID):
    return (AdapterVersion.tenant_id == tenant_id) & AdapterVersion.objects_purged_at.is_(None)


def stored_uris(session: Session, tenant_id: uuid.UUID) -> set[str]:
    files = select(AdapterVersion.storage_uri.label("uri")).where(_kept(tenant_id))
    evals = (select(AdapterVersion.eval_set_uri.label("uri"))
             .where(_kept(tenant_id), AdapterVersion.eval_set_uri.is_not(None)))
    return set(session.scalars(union_all(files, evals)))


def used_bytes(session: Session, tenant_id: uuid.UUID) -> int:
    files = (select(AdapterVersion.storage_uri.label("uri"), func.max(AdapterVersion.size_bytes).label("size"))
             .where(_kept(tenant_id)).group_by(AdapterVersion.storage_uri))
    evals = (select(AdapterVersion.eval_set_uri.label("uri"),
                    func.max(func.coalesce(AdapterVersion.eval_set_bytes, 0)).label("size"))
             .where(_kept(tenant_id), AdapterVersion.eval_set_uri.is_not(None)).group_by(AdapterVersion.eval_set_uri))
    both = union_all(files, evals).subquery()
    return int(session.scalar(select(func.coalesce(func.sum(both.c.size), 0))))


def quota_bytes(session: Session, tenant_id: uuid.UUID, *, default: int) -> int:
    own = session.scalar(select(TenantLimits.storage_quota_bytes).where(TenantLimits.tenant_id == tenant_id))
    return default if own is None else int(own)


def storage_usage(session: Session, tenant_id: uuid.UUID, *, default_quota: int) -> StorageUsage:
    return StorageUsage(tenant_id, used_bytes(session, tenant_id), quota_bytes(session, tenant_id, default=default_quota))


def admit(session: Session, tenant_id: uuid.UUID, new: Iterable[StoredObject | None], *, default_quota: int) -> StorageUsage:
    """Refuse (413) an upload whose new objects would take the tenant over its quota; objects the tenant
    already stores cost nothing. Holds a per-tenant lock until the caller's transaction ends, so two uploads
    of one tenant cannot both pass on the same remaining bytes."""
    session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": f"mplex-storage:{tenant_id}"})
    usage = storage_usage(session, tenant_id, default_quota=default_quota)
    have = stored_uris(session, tenant_id)
    extra = sum(o.size_bytes for o in {o.uri: o for o in new if o is not None and o.uri not in have}.values())
    if usage.used_bytes + extra > usage.quota_bytes:
        raise StorageQuotaExceeded(
            f"Storage quota exceeded: this upload needs {_size(extra)} but the tenant already uses "
            f"{_size(usage.used_bytes)} of its {_size(usage.quota_bytes)} adapter storage quota "
            f"({_size(usage.remaining_bytes)} left). Delete adapters you no longer need (rejected uploads' files are "
            f"removed after their retention period) or ask a platform admin for a larger quota.",
            param="file")
    return usage


def _size(n: int) -> str:
    """Bytes for people, with the exact count: '1.5 MiB (1,572,864 bytes)'."""
    value, unit = float(n), "bytes"
    for u in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, u
    return f"{n:,} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({n:,} bytes)"
