"""Storage hygiene on real Postgres and a real object store (services.adapters.retention, .quota): rejected
versions' files go after their retention and not before; objects a keeping version references never go —
shared by a live and a rejected version, or by two tenants; deleted adapters' files go after theirs;
unreferenced objects and stale temporary files and sandboxes are collected; an upload in flight holds its
object against the collector; every collection is idempotent; the storage quota refuses an upload (413)
before anything is written."""
from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlalchemy.exc import DBAPIError

from services.adapters import retention
from services.adapters.quota import StorageQuotaExceeded, storage_usage, used_bytes
from services.common.errors import ConflictError
from services.common.models import Adapter, AdapterStatus, AdapterVersion, TenantLimits
from services.gateway import crud
from tests.adapters.corpus import adapter_tar, good_config, good_weights
from tests.adapters.helpers import ACTOR, eval_jsonl, greedy_texts, upload, version
from tests.adapters.tinymodel import WORDS, write_adapter
from tests.factories import make_tenant

DAY = 86_400.0
PROMPTS = [" ".join(WORDS[i:i + 3]) for i in range(0, 24, 3)]


def purge(rt, **kw):
    return retention.purge_expired(rt.session_factory, rt.store, rejected_retention_s=kw.get("rejected", DAY),
                                   deleted_retention_s=kw.get("deleted", DAY))


def exists(rt, uri: str) -> bool:
    """A blob, or a version's prefix (a directory in a local store)."""
    if uri.split("/")[-2] == "adapters":
        return Path(rt.store.root, rt.store.key_of(uri)).is_dir()
    return rt.store.exists(uri)


def backdate(rt, version_id=None, *, adapter_id=None, days: float = 2) -> None:
    """What time does: the rejection (the version's last change) or the deletion happened `days` ago."""
    when = datetime.now(timezone.utc) - timedelta(days=days)
    with rt.session_factory() as s:
        if version_id is not None:
            s.execute(update(AdapterVersion).where(AdapterVersion.id == version_id).values(updated_at=when))
        if adapter_id is not None:
            s.execute(update(Adapter).where(Adapter.id == adapter_id).values(deleted_at=when))
        s.commit()


def unique_adapter(tmp_path: Path, dims, name: str) -> Path:
    return write_adapter(tmp_path / name, dims, rank=4, seed=uuid.uuid4().int % 100_000)


@pytest.fixture
def evalsets(tiny_base, tiny_dims, tmp_path):
    """An adapter and eval sets it passes (its own outputs) and fails (the base's) with the margin check."""
    adapter = write_adapter(tmp_path / "strong", tiny_dims, rank=8, targets=("q_proj", "v_proj", "down_proj"), b_std=0.4,
                            seed=uuid.uuid4().int % 100_000)
    return {"adapter": adapter, "wins": eval_jsonl(PROMPTS, greedy_texts(tiny_base, PROMPTS, adapter_dir=adapter)),
            "loses": eval_jsonl(PROMPTS, greedy_texts(tiny_base, PROMPTS))}


def relaxed(rt):
    """Thresholds under which the tiny random model's outputs pass (this file is about storage, not the gate)."""
    from dataclasses import replace

    rt.config = replace(rt.config, gate=replace(rt.config.gate, max_malformed_rate=1.0))
    return rt


def test_rejected_files_are_removed_after_their_retention_and_never_before(runtime, db, tiny_dims):
    tenant = make_tenant(db)
    data = adapter_tar(good_config(auto_map={"AutoModel": "x.Y"}), good_weights(tiny_dims))
    hostile = upload(runtime, tenant, "hostile", data=data, eval_set=eval_jsonl(["a"], ["b"]))
    runtime.enqueue.ingest(hostile.version_id)
    v = version(runtime, hostile.version_id)
    assert v.status == AdapterStatus.REJECTED and runtime.store.key_of(v.storage_uri).startswith("uploads/")
    uris = [v.storage_uri, v.eval_set_uri]
    assert all(runtime.store.exists(u) for u in uris)

    report = purge(runtime)  # rejected just now: within its retention (an admin may still override it)
    assert hostile.version_id not in report.purged_versions and all(runtime.store.exists(u) for u in uris)

    backdate(runtime, hostile.version_id, days=2)
    report = purge(runtime)
    assert hostile.version_id in report.purged_versions and set(uris) <= set(report.deleted)
    assert not any(runtime.store.exists(u) for u in uris)
    assert version(runtime, hostile.version_id).objects_purged_at is not None
    # Its files are gone: it can never be made ready (the override says so; the database refuses anyway).
    with runtime.session_factory() as s:
        with pytest.raises(ConflictError, match="removed after its retention"):
            crud.override_version(s, version_id=hostile.version_id, decision="ready", reason="try", actor=ACTOR)
        s.rollback()
        with pytest.raises(DBAPIError, match="cannot become ready"):
            s.execute(update(AdapterVersion).where(AdapterVersion.id == hostile.version_id)
                      .values(status=AdapterStatus.READY, ready_at=datetime.now(timezone.utc)))
        s.rollback()
    again = purge(runtime)  # idempotent: nothing left to do
    assert hostile.version_id not in again.purged_versions and not set(uris) & set(again.deleted)


def test_an_object_shared_by_a_live_version_and_a_rejected_one_is_kept(runtime, db, evalsets):
    """Same files: tenant A's upload is rejected (its eval set), tenant B's is ready, and A's next version of the
    same files too. Purging A's rejected version keeps the files (counted by the database), removes A's own
    eval set, and B (and A's v2) still load them."""
    rt = relaxed(runtime)
    a, b = make_tenant(db), make_tenant(db)
    a1 = upload(rt, a, "shared", evalsets["adapter"], eval_set=evalsets["loses"], min_fp8_agreement=0.0)
    b1 = upload(rt, b, "shared", evalsets["adapter"], eval_set=evalsets["wins"], min_margin=-1.0, min_fp8_agreement=0.0)
    for r in (a1, b1):
        rt.enqueue.ingest(r.version_id)
    va, vb = version(rt, a1.version_id), version(rt, b1.version_id)
    assert (va.status, vb.status) == (AdapterStatus.REJECTED, AdapterStatus.READY), (va.status_reasons, vb.status_reasons)
    assert va.storage_uri == vb.storage_uri and va.eval_set_uri != vb.eval_set_uri
    backdate(rt, a1.version_id, days=30)
    report = purge(rt)
    assert a1.version_id in report.purged_versions
    assert va.storage_uri in report.kept_shared and va.storage_uri not in report.deleted
    assert va.eval_set_uri in report.deleted and not rt.store.exists(va.eval_set_uri)
    assert rt.store.exists(vb.eval_set_uri)
    fetched = rt.store.fetch(vb.storage_uri, rt.sandbox_root / "fetch-b")
    assert sorted(p.name for p in fetched.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # The orphan collector agrees: B's version references the files.
    orphans = retention.collect_orphans(rt.session_factory, rt.store, grace_s=0)
    assert vb.storage_uri not in orphans.deleted and rt.store.exists(vb.storage_uri)


def test_a_deleted_adapters_files_go_after_its_retention_unless_another_tenant_uses_them(runtime, db, tiny_dims, tmp_path):
    rt = relaxed(runtime)
    a, b = make_tenant(db), make_tenant(db)
    shared = unique_adapter(tmp_path, tiny_dims, "shared")
    alone = unique_adapter(tmp_path, tiny_dims, "alone")
    wins = eval_jsonl(["x"], ["y"])
    ups = {key: upload(rt, tenant, key, d, eval_set=wins, min_margin=-1.0, min_fp8_agreement=0.0)
           for key, tenant, d in (("a-shared", a, shared), ("a-alone", a, alone), ("b-shared", b, shared))}
    for r in ups.values():
        rt.enqueue.ingest(r.version_id)
    assert {k: version(rt, r.version_id).status for k, r in ups.items()} == dict.fromkeys(ups, AdapterStatus.READY)
    with rt.session_factory() as s:
        for key in ("a-shared", "a-alone"):
            crud.delete_adapter(s, adapter_id=ups[key].adapter_id, actor=ACTOR)
        s.commit()
    assert not purge(rt).purged_versions  # deleted just now: within the retention
    for key in ("a-shared", "a-alone"):
        backdate(rt, adapter_id=ups[key].adapter_id, days=2)
    report = purge(rt)
    assert {ups["a-shared"].version_id, ups["a-alone"].version_id} <= set(report.purged_versions)
    alone_uri, shared_uri = (version(rt, ups[k].version_id).storage_uri for k in ("a-alone", "a-shared"))
    assert alone_uri in report.deleted and not exists(rt, alone_uri)
    assert shared_uri in report.kept_shared and exists(rt, shared_uri)  # tenant b's live adapter uses it
    assert ups["b-shared"].version_id not in report.purged_versions


def test_unreferenced_objects_and_stale_leftovers_are_collected_and_nothing_else(runtime, db, tiny_dims, tmp_path):
    rt = relaxed(runtime)
    tenant = make_tenant(db)
    kept = upload(rt, tenant, "kept", unique_adapter(tmp_path, tiny_dims, "kept"))
    kept_uri = version(rt, kept.version_id).storage_uri
    # An upload whose transaction failed after writing its files, and one still inside its grace period.
    orphan = rt.store.put_version(unique_adapter(tmp_path, tiny_dims, "orphan"))
    fresh = rt.store.put_version(unique_adapter(tmp_path, tiny_dims, "fresh"))
    blob = tmp_path / "stray.jsonl"
    blob.write_text('{"prompt": "p", "expected": "e"}\n')
    stray = rt.store.put_blob(blob, "evalsets", ".jsonl")
    old = time.time() - 3 * 3600
    for uri in (orphan.uri, stray.uri, kept_uri):
        age(Path(rt.store.root, rt.store.key_of(uri)), old)
    # A writer that died before its rename, a gateway that died mid-upload, and a sandbox in use right now.
    tmp_file = Path(rt.store.root, "uploads", ".tmp-deadbeef")
    tmp_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file.write_bytes(b"x" * 1000)
    dead = rt.sandbox_root / "upload-dead"
    (dead / "part-0").parent.mkdir(parents=True)
    (dead / "part-0").write_bytes(b"y" * 2000)
    live = rt.sandbox_root / "ingest-live"
    live.mkdir()
    (live / "adapter").write_bytes(b"z")
    for path in (tmp_file, dead):
        age(path, time.time() - 7 * 3600)

    report = retention.collect(rt.session_factory, rt.store, replace_config(rt.config, orphan_grace_s=3600),
                               sandbox_root=rt.sandbox_root)
    assert set(report.deleted) == {orphan.uri, stray.uri}
    assert not rt.store.exists(stray.uri) and not exists(rt, orphan.uri)
    assert exists(rt, fresh.uri) and exists(rt, kept_uri)  # in its grace period; referenced
    assert report.temporary_removed == [f"{rt.store.url}/uploads/.tmp-deadbeef"] and not tmp_file.exists()
    assert report.sandboxes_removed == [str(dead)] and not dead.exists() and live.exists()
    assert report.bytes_freed >= orphan.size_bytes + stray.size_bytes + 3000
    # Safe to run twice (and beat may): the second run finds nothing.
    again = retention.collect(rt.session_factory, rt.store, replace_config(rt.config, orphan_grace_s=3600),
                              sandbox_root=rt.sandbox_root)
    assert again.as_dict() == retention.CollectReport().as_dict()


def test_an_upload_in_flight_holds_its_object_against_the_collector(runtime, db, tiny_dims, tmp_path):
    """The race: an old orphan with the same bytes as an upload that has written its files but not yet
    committed its version. The collector must neither delete the files under the upload nor wait for it."""
    orphan = runtime.store.put_version(unique_adapter(tmp_path, tiny_dims, "race"))
    age(Path(runtime.store.root, runtime.store.key_of(orphan.uri)), time.time() - 3 * 3600)
    with runtime.session_factory() as uploading:
        retention.hold_object(uploading, orphan.uri)  # what upload_adapter does before writing
        report = retention.collect_orphans(runtime.session_factory, runtime.store, grace_s=0)
        assert report.busy == [orphan.uri] and exists(runtime, orphan.uri)
        uploading.rollback()  # the upload failed after all
    report = retention.collect_orphans(runtime.session_factory, runtime.store, grace_s=0)
    assert report.deleted == [orphan.uri] and not exists(runtime, orphan.uri)


def test_the_storage_quota_refuses_an_upload_before_writing_it(runtime, db, tiny_dims, tmp_path):
    tenant = make_tenant(db)
    first = unique_adapter(tmp_path, tiny_dims, "first")
    size = sum(p.stat().st_size for p in first.iterdir())
    db.add(TenantLimits(tenant_id=tenant.id, storage_quota_bytes=size + 100))
    db.commit()
    r1 = upload(runtime, tenant, "first", first)
    with runtime.session_factory() as s:
        usage = storage_usage(s, tenant.id, default_quota=runtime.config.storage_quota_bytes)
    assert (usage.used_bytes, usage.quota_bytes, usage.remaining_bytes) == (size, size + 100, 100)
    objects_before = sorted(o.uri for o in runtime.store.list_objects())
    second = unique_adapter(tmp_path, tiny_dims, "second")
    with pytest.raises(StorageQuotaExceeded) as refused:
        upload(runtime, tenant, "second", second)
    err = refused.value
    assert (err.status, err.code, err.type) == (413, "storage_quota_exceeded", "invalid_request_error")
    assert f"{size:,} bytes" in err.message and f"{size + 100:,} bytes" in err.message  # current use and the quota
    assert sorted(o.uri for o in runtime.store.list_objects()) == objects_before  # nothing written
    # The same files again cost nothing: a new version is accepted.
    again = upload(runtime, tenant, "first", first)
    assert again.version == 2
    with runtime.session_factory() as s:
        assert used_bytes(s, tenant.id) == size
    # Purged files no longer count.
    with runtime.session_factory() as s:
        s.execute(update(AdapterVersion).where(AdapterVersion.id.in_([r1.version_id, again.version_id]))
                  .values(status=AdapterStatus.REJECTED, objects_purged_at=datetime.now(timezone.utc)))
        s.commit()
        assert used_bytes(s, tenant.id) == 0


def age(path: Path, when: float) -> None:
    """Set the modification time of `path` and everything under it."""
    targets = [path] + (list(path.rglob("*")) if path.is_dir() else [])
    for p in targets:
        os.utime(p, (when, when))


def replace_config(config, **changes):
    from dataclasses import replace

    return replace(config, **changes)
