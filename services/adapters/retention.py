"""Storage hygiene for adapter files: retention of rejected and deleted versions, garbage collection of objects
no version references, and removal of leftover temporary files and sandboxes. Run by beat
(`adapters.ingest.collect_storage`); every function here is idempotent and safe to run twice or concurrently.

The rule: an object (a version's files, an upload kept as received, an eval set) is removed only when no
adapter version that *keeps its files* references it — counted by the database, never guessed from a path,
because content-addressed objects are shared by versions and tenants. A version keeps its files until:
  - it was rejected more than `rejected_retention_s` ago (until then an admin may still override it), or
  - its adapter was deleted more than `deleted_retention_s` ago;
then its objects that no other keeping version references are deleted and the version is marked
`objects_purged_at` (it can never become ready again: the database refuses).

Uploads and the collector meet on a per-object Postgres advisory lock: an upload holds it (shared) from before
it writes an object until its version row commits; the collector takes it (exclusive, without waiting) to
re-check the references and delete. So an object is never deleted between an upload writing it and the
upload's version referencing it — an upload that follows a deletion writes the object again.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import and_, exists, func, or_, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from services.adapters.storage import ObjectStore
from services.common.models import Adapter, AdapterStatus, AdapterVersion

log = logging.getLogger("mplex.adapters.retention")

_FINAL = (AdapterStatus.READY, AdapterStatus.REJECTED)


# -- the object lock uploads and the collector share ------------------------------------------------------------
def _lock_key(uri: str) -> dict[str, str]:
    return {"k": f"mplex-object:{uri}"}


def hold_object(session: Session, uri: str) -> None:
    """Upload side: a shared lock on the object until this transaction ends (take it before writing)."""
    session.execute(text("SELECT pg_advisory_xact_lock_shared(hashtextextended(:k, 0))"), _lock_key(uri))


def _try_claim(session: Session, uri: str) -> bool:
    """Collector side: the exclusive lock, or False at once if an upload holds the object."""
    return bool(session.scalar(text("SELECT pg_try_advisory_xact_lock(hashtextextended(:k, 0))"), _lock_key(uri)))


# -- which versions keep their files --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Cutoffs:
    rejected_before: datetime
    deleted_before: datetime

    @classmethod
    def at(cls, now: datetime, *, rejected_retention_s: float, deleted_retention_s: float) -> Cutoffs:
        return cls(now - timedelta(seconds=rejected_retention_s), now - timedelta(seconds=deleted_retention_s))


def _expired(c: Cutoffs):
    """A final version past its retention (the adapter row must be joined as `Adapter`)."""
    return and_(AdapterVersion.status.in_(_FINAL),
                or_(and_(AdapterVersion.status == AdapterStatus.REJECTED, AdapterVersion.updated_at < c.rejected_before),
                    and_(Adapter.deleted_at.is_not(None), Adapter.deleted_at < c.deleted_before)))


def _keeping_reference(uri: str, c: Cutoffs | None):
    """Some version that keeps its files references `uri`. With no cutoffs: any version not purged (the
    orphan collector's question: expired versions are the purge's business, and keep their objects until it)."""
    refs = or_(AdapterVersion.storage_uri == uri, AdapterVersion.eval_set_uri == uri)
    q = select(AdapterVersion.id).join(Adapter, Adapter.id == AdapterVersion.adapter_id).where(
        refs, AdapterVersion.objects_purged_at.is_(None))
    if c is not None:
        q = q.where(~_expired(c))
    return exists(q)


# -- results ----------------------------------------------------------------------------------------------------
@dataclass
class CollectReport:
    purged_versions: list[uuid.UUID] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)  # object URIs removed
    kept_shared: list[str] = field(default_factory=list)  # objects of purged versions that other versions still use
    busy: list[str] = field(default_factory=list)  # objects an upload held: tried again on the next run
    temporary_removed: list[str] = field(default_factory=list)
    sandboxes_removed: list[str] = field(default_factory=list)
    bytes_freed: int = 0

    def as_dict(self) -> dict:
        return {"purged_versions": len(self.purged_versions), "deleted": len(self.deleted),
                "kept_shared": len(self.kept_shared), "busy": len(self.busy),
                "temporary_removed": len(self.temporary_removed), "sandboxes_removed": len(self.sandboxes_removed),
                "bytes_freed": self.bytes_freed}


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _delete_unless_kept(session_factory: sessionmaker[Session], store: ObjectStore, uri: str, c: Cutoffs | None,
                        report: CollectReport) -> str:
    """Delete `uri` if no keeping version references it: "deleted", "kept" or "busy"."""
    with session_factory() as s:
        if not _try_claim(s, uri):
            report.busy.append(uri)
            return "busy"
        if s.scalar(select(_keeping_reference(uri, c))):
            s.rollback()
            return "kept"
        report.bytes_freed += store.delete(uri)
        report.deleted.append(uri)
        s.commit()  # releases the lock
    return "deleted"


# -- retention --------------------------------------------------------------------------------------------------
def purge_expired(session_factory: sessionmaker[Session], store: ObjectStore, *, rejected_retention_s: float,
                  deleted_retention_s: float, now: datetime | None = None, limit: int = 500,
                  report: CollectReport | None = None) -> CollectReport:
    """Remove the files of versions past their retention that no keeping version shares, and mark them
    purged. A version whose object an upload holds right now stays unmarked and is retried on the next run."""
    report = report or CollectReport()
    c = Cutoffs.at(now or _now(), rejected_retention_s=rejected_retention_s, deleted_retention_s=deleted_retention_s)
    with session_factory() as s:
        rows = s.execute(select(AdapterVersion.id, AdapterVersion.storage_uri, AdapterVersion.eval_set_uri)
                         .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
                         .where(AdapterVersion.objects_purged_at.is_(None), _expired(c))
                         .order_by(AdapterVersion.created_at).limit(limit)).all()
    for version_id, storage_uri, eval_uri in rows:
        outcomes = [_delete_unless_kept(session_factory, store, uri, c, report) for uri in (storage_uri, eval_uri) if uri]
        if "busy" in outcomes:
            continue
        report.kept_shared.extend(uri for uri, o in zip((storage_uri, eval_uri), outcomes) if o == "kept")
        with session_factory() as s:
            done = s.execute(update(AdapterVersion).where(AdapterVersion.id == version_id,
                                                          AdapterVersion.objects_purged_at.is_(None))
                             .values(objects_purged_at=func.now())).rowcount
            s.commit()
        if done:
            report.purged_versions.append(version_id)
    return report


# -- garbage collection -----------------------------------------------------------------------------------------
def collect_orphans(session_factory: sessionmaker[Session], store: ObjectStore, *, grace_s: float,
                    now: float | None = None, report: CollectReport | None = None) -> CollectReport:
    """Delete objects that no unpurged version references and that are older than `grace_s`: an upload whose
    transaction failed after writing its files, files left by a purge that stopped halfway, anything that
    was never recorded."""
    report = report or CollectReport()
    cutoff = (now if now is not None else time.time()) - grace_s
    for obj in store.list_objects():
        if obj.modified > cutoff:
            continue
        with session_factory() as s:
            referenced = s.scalar(select(_keeping_reference(obj.uri, None)))
        if not referenced:
            _delete_unless_kept(session_factory, store, obj.uri, None, report)
    return report


def collect_temporary(store: ObjectStore, sandbox_root: Path | None, *, max_age_s: float, now: float | None = None,
                      report: CollectReport | None = None) -> CollectReport:
    """Temporary object files (a writer died before its rename) and private sandboxes (a gateway or worker
    died mid-upload or mid-validation) untouched for `max_age_s`: nothing live is that old."""
    report = report or CollectReport()
    cutoff = (now if now is not None else time.time()) - max_age_s
    for tmp in store.list_temporary():
        if tmp.modified <= cutoff:
            report.bytes_freed += store.delete(tmp.uri)
            report.temporary_removed.append(tmp.uri)
    if sandbox_root is not None and Path(sandbox_root).is_dir():
        for entry in Path(sandbox_root).iterdir():
            if _newest_mtime(entry) <= cutoff:
                size = _tree_size(entry)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                report.bytes_freed += size
                report.sandboxes_removed.append(str(entry))
    return report


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
                except FileNotFoundError:
                    continue
    return newest


def _tree_size(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total


def collect(session_factory: sessionmaker[Session], store: ObjectStore, config, *,
            sandbox_root: Path | None) -> CollectReport:
    """Everything above, in order (what the beat task runs)."""
    report = purge_expired(session_factory, store, rejected_retention_s=config.rejected_retention_s,
                           deleted_retention_s=config.deleted_retention_s)
    collect_orphans(session_factory, store, grace_s=config.orphan_grace_s, report=report)
    collect_temporary(store, sandbox_root, max_age_s=config.staging_max_age_s, report=report)
    if report.deleted or report.purged_versions or report.temporary_removed or report.sandboxes_removed:
        log.info("storage collected: %s", report.as_dict())
    return report
