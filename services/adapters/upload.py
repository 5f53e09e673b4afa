"""Creating an adapter version from an upload: the one plain function behind the HTTP API, the CLI and the
demo seed, so all three store, name, number and audit versions the same way.

The upload (one archive; loose PEFT files are packed into a tar first) is unpacked into a private sandbox
only to learn its content id and store its two files content-addressed. Nothing about the adapter is
judged here: an upload that cannot even be unpacked is stored as-is under `uploads/<sha256>` and its
version goes through the pipeline like any other, where validation records why it is refused.

Before anything is written, the tenant's storage quota is checked (services.adapters.quota: 413 when the
new objects would not fit), and each object is held against the garbage collector until the version row
that references it commits (services.adapters.retention).
"""
from __future__ import annotations

import re
import shutil
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.adapters.archive import sniff_kind, unpack
from services.adapters.config import PipelineConfig
from services.adapters.evalset import EvalSetError, parse_eval_set
from services.adapters.quota import admit
from services.adapters.retention import hold_object
from services.adapters.storage import ObjectStore, StoredObject
from services.common.errors import InvalidRequestError, NotFoundError
from services.common.lora_format import AdapterFormatError
from services.common.models import Adapter, AdapterStatus, AdapterVersion, BaseModelRecord, Tenant
from services.common.models.adapters import ADAPTER_NAME_PATTERN
from services.common.audit import Actor, record_audit

_NAME = re.compile(ADAPTER_NAME_PATTERN)


@dataclass(frozen=True, slots=True)
class UploadResult:
    version_id: uuid.UUID
    adapter_id: uuid.UUID
    version: int
    status: str
    content_sha256: str
    created: bool  # False: a version of the same files and eval set already existed and was returned (reuse_identical)

    def as_response(self) -> dict:
        return {"version_id": str(self.version_id), "adapter_id": str(self.adapter_id), "version": self.version,
                "status": self.status}


@contextmanager
def private_dir(root: Path, prefix: str) -> Iterator[Path]:
    """A fresh 0700 directory under `root`, removed with everything in it afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pack_files(files: list[tuple[str, Path]], out: Path) -> Path:
    """Loose uploaded files as one plain tar, under the names the client gave (validation judges them)."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in files:
            info = tarfile.TarInfo(name)  # verbatim: an absolute or '..' name must reach validation as such
            info.size = path.stat().st_size
            info.mode = 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
    return out


def pack_dir(adapter_dir: Path, out: Path) -> Path:
    """A local adapter directory (the CLI, the seed) as one plain tar; symlinks stay links (and are refused)."""
    adapter_dir = Path(adapter_dir)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(adapter_dir.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(adapter_dir)), recursive=False)
    return out


def check_thresholds(min_margin: float | None, min_fp8_agreement: float | None) -> None:
    if min_margin is not None and not -1 <= min_margin <= 1:
        raise InvalidRequestError("min_margin must be between -1 and 1", param="min_margin", code="invalid_threshold")
    if min_fp8_agreement is not None and not 0 <= min_fp8_agreement <= 1:
        raise InvalidRequestError("min_fp8_agreement must be between 0 and 1", param="min_fp8_agreement",
                                  code="invalid_threshold")


def identify_upload(store: ObjectStore, upload: Path, *, config: PipelineConfig,
                    sandbox: Path) -> tuple[StoredObject, Path | None]:
    """Where the upload will be stored, without writing it: its two PEFT files (unpacked into `sandbox`,
    returned) under their bytes' hash, or — when it cannot be unpacked or identified — the upload itself
    under `uploads/<sha256>` (None) for the pipeline to refuse with a reason."""
    target = sandbox / "unpacked"
    target.mkdir(mode=0o700)
    try:
        unpacked = unpack(upload, target, config.archive)
        return store.plan_version(unpacked.dir), unpacked.dir
    except AdapterFormatError:
        pass
    return store.plan_blob(upload, "uploads", _raw_suffix(upload)), None


def _raw_suffix(upload: Path) -> str:
    try:
        return "." + sniff_kind(upload)
    except AdapterFormatError:
        return ".bin"


def upload_adapter(
    session: Session,
    *,
    store: ObjectStore,
    config: PipelineConfig,
    sandbox_root: Path,
    base: BaseModelRecord,
    tenant_id: uuid.UUID,
    name: str,
    upload: Path,
    actor: Actor,
    eval_set: bytes | None = None,
    min_margin: float | None = None,
    min_fp8_agreement: float | None = None,
    reuse_identical: bool = False,
) -> UploadResult:
    """Store the upload and create the adapter (if new) and its next version in `uploaded`; flushes, the
    caller commits and then enqueues ingest (`services.adapters.tasks.enqueue_ingest`)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError("name must be 1-64 characters of letters, digits, '.', '_' and '-', starting with a "
                                  "letter or digit", param="name", code="invalid_name")
    check_thresholds(min_margin, min_fp8_agreement)
    if session.get(Tenant, tenant_id) is None:
        raise NotFoundError("Tenant not found.")
    if eval_set is not None:
        if len(eval_set) > config.max_eval_set_bytes:
            raise InvalidRequestError(f"the eval set is larger than {config.max_eval_set_bytes} bytes", param="eval_set",
                                      code="invalid_eval_set")
        try:
            parse_eval_set(eval_set, max_items=config.max_eval_items)
        except EvalSetError as exc:
            raise InvalidRequestError(f"eval_set: {exc}", param="eval_set", code=exc.code) from None
    with private_dir(sandbox_root, "identify-") as sandbox:
        planned, files = identify_upload(store, upload, config=config, sandbox=sandbox)
        planned_eval = None
        if eval_set is not None:
            (sandbox / "eval.jsonl").write_bytes(eval_set)
            planned_eval = store.plan_blob(sandbox / "eval.jsonl", "evalsets", ".jsonl")
        admit(session, tenant_id, [planned, planned_eval], default_quota=config.storage_quota_bytes)
        for obj in (planned, planned_eval):
            if obj is not None:
                hold_object(session, obj.uri)  # until this transaction commits the version that references it
        # The files in the sandbox are the ones just hashed: the plan is their key (no second hashing pass).
        stored = (store.put_version(files, planned) if files is not None
                  else store.put_blob(upload, "uploads", _raw_suffix(upload), planned))
        eval_uri = store.put_blob(sandbox / "eval.jsonl", "evalsets", ".jsonl", planned_eval).uri if planned_eval else None

    adapter = _live_adapter(session, tenant_id=tenant_id, name=name, base_model_id=base.id, actor=actor)
    versions = list(session.scalars(select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id)
                                    .order_by(AdapterVersion.version)))
    if reuse_identical:
        same = [v for v in versions if v.storage_uri == stored.uri and v.eval_set_uri == eval_uri
                and v.objects_purged_at is None]
        if same:
            v = same[-1]
            return UploadResult(v.id, adapter.id, v.version, str(v.status), v.content_sha256, created=False)
    number = 1 + max((v.version for v in versions), default=0)
    version = AdapterVersion(
        adapter_id=adapter.id, tenant_id=tenant_id, version=number, base_model_id=base.id,
        content_sha256=stored.sha256, storage_uri=stored.uri, size_bytes=stored.size_bytes,
        status=AdapterStatus.UPLOADED, progress_percent=0, progress_step="queued for validation",
        eval_set_uri=eval_uri, eval_set_bytes=planned_eval.size_bytes if planned_eval else None,
        gate_config=config.gate.thresholds(min_margin=min_margin, min_fp8_agreement=min_fp8_agreement),
        created_by=actor.user_id,
    )
    session.add(version)
    session.flush()
    record_audit(session, actor=actor, action="adapter.upload", tenant_id=tenant_id, target_type="adapter_version",
                 target_id=version.id, details={"adapter": name, "version": number, "content_sha256": stored.sha256,
                                                "size_bytes": stored.size_bytes, "eval_set": eval_uri is not None,
                                                "gate": version.gate_config})
    return UploadResult(version.id, adapter.id, number, str(version.status), stored.sha256, created=True)


def _live_adapter(session: Session, *, tenant_id: uuid.UUID, name: str, base_model_id, actor: Actor) -> Adapter:
    """The tenant's live adapter of that name, created if missing, locked for this transaction (so version
    numbers are assigned one at a time)."""
    created = session.scalar(
        insert(Adapter).values(id=_new_id(), tenant_id=tenant_id, name=name, base_model_id=base_model_id,
                               created_by=actor.user_id)
        .on_conflict_do_nothing(index_elements=[Adapter.tenant_id, Adapter.name],
                                index_where=Adapter.deleted_at.is_(None))
        .returning(Adapter.id)
    )
    adapter = session.scalar(
        select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.deleted_at.is_(None))
        .with_for_update()
    )
    assert adapter is not None
    if created is not None:
        record_audit(session, actor=actor, action="adapter.create", tenant_id=tenant_id, target_type="adapter",
                     target_id=adapter.id, details={"adapter": name})
    return adapter


def _new_id() -> uuid.UUID:
    from services.common.ids import uuid7

    return uuid7()


def upload_from_path(path: Path, *, tenant: str, name: str, eval_set: bytes | None, staging: Path,
                min_margin: float | None = None, min_fp8_agreement: float | None = None, reuse_identical: bool = False,
                settings=None, session_factory=None):
    """An upload from a local path, as the CLI and the demo seed make it: pack a directory, then `upload_adapter`."""
    from services.adapters.base_model import base_model_dir, ensure_base_model
    from services.adapters.config import PipelineConfig
    from services.adapters.storage import ObjectStore
    from services.common.db import session_scope
    from services.common.settings import get_settings
    from services.common.audit import find_tenant

    settings = settings or get_settings()
    config = PipelineConfig.from_env()
    archive = pack_dir(path, staging / "upload.tar") if path.is_dir() else path
    with session_scope(session_factory) as s:
        t = find_tenant(s, ref=tenant)
        base = ensure_base_model(s, name=settings.base_model_name, model_dir=base_model_dir(settings),
                                 max_lora_rank=config.max_lora_rank)
        return upload_adapter(s, store=ObjectStore.from_settings(settings), config=config,
                              sandbox_root=settings.home / "sandbox", base=base, tenant_id=t.id, name=name,
                              upload=archive, actor=Actor.cli(), eval_set=eval_set, min_margin=min_margin,
                              min_fp8_agreement=min_fp8_agreement, reuse_identical=reuse_identical)
