"""Results streamed to the object store in parts (services.batch.parts) on a real Postgres and a real file
object store: a flush killed between its object write and its commit loses and duplicates nothing, the
files assembled at the end hold every answered line once, and a cancel keeps what was answered."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import sessionmaker

from services.adapters.storage import ObjectStore
from services.batch import checkpoint, parts
from services.common.batch_contract import SERVICE_TIER, BatchStatus, LineState, line_request_id
from services.common.models import Batch, BatchFile, BatchLine, BatchPart, UsageEvent
from services.gateway.batch_files import create_batch, put_file
from services.gateway.metering import UsageRecord
from tests.factories import make_tenant

N = 25


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore(f"file://{tmp_path}/objects")


@pytest.fixture
def factory(db_engine):
    return sessionmaker(db_engine, expire_on_commit=False)


def _batch(db, store: ObjectStore, n: int = N) -> uuid.UUID:
    tenant = make_tenant(db)
    data = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "demo", "messages": [{"role": "user", "content": f"hi {i}"}]}}).encode()
                    + b"\n" for i in range(n))
    f = put_file(store, db, tenant_id=tenant.id, data=data, filename="in.jsonl", purpose="batch", line_count=n)
    b = create_batch(db, tenant_id=tenant.id, api_key_id=None, input_file=f, data=data, endpoint="/v1/chat/completions",
                     completion_window="24h", metadata=None)
    b.status = BatchStatus.IN_PROGRESS
    db.commit()
    return b.id


def _answer(factory, batch_id: uuid.UUID, line_nos, *, failed: set[int] = frozenset()) -> None:
    by_no = {p.line_no: p for p in checkpoint.pending(factory, batch_id, after=0, limit=10_000)}
    for n in line_nos:
        line, bad = by_no[n], n in failed
        body = {"error": {"message": "no"}} if bad else {"choices": [{"message": {"content": f"answer {n}"}}]}
        tenant_id = _tenant(factory, batch_id)
        rec = UsageRecord(request_id=line_request_id(batch_id, n), tenant_id=tenant_id, api_key_id=None, model="demo",
                          base_model="demo", adapter_version_id=None, prompt_tokens=3, cached_tokens=0,
                          completion_tokens=0 if bad else 2, status="error" if bad else "ok", http_status=400 if bad else 200,
                          created_at=datetime.now(timezone.utc), service_tier=SERVICE_TIER)
        assert checkpoint.record(factory, batch_id, line, state=LineState.FAILED if bad else LineState.DONE,
                                 status_code=400 if bad else 200, body=body, usage=rec)


def _tenant(factory, batch_id):
    with factory() as s:
        return s.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))


def _lines(store: ObjectStore, db, file_id) -> list[dict]:
    row = db.get(BatchFile, file_id)
    return [json.loads(x) for x in store.read_bytes(row.storage_uri, max_bytes=1 << 24).splitlines()]


def test_answered_lines_leave_postgres_for_parts_as_they_finish(db, store, factory):
    batch_id = _batch(db, store)
    _answer(factory, batch_id, range(1, 11), failed={4})
    assert parts.flush(factory, store, batch_id) == 10
    with factory() as s:
        c = parts.check(s, batch_id)
        assert (c.unflushed, c.in_parts, c.parts, c.counts_agree) == (0, 10, 2, True)
        # Postgres no longer holds these results: they are in the object store, one part per kind.
        assert s.scalar(select(BatchLine.result).where(BatchLine.batch_id == batch_id, BatchLine.line_no == 1)) is None
        ps = list(s.scalars(select(BatchPart).where(BatchPart.batch_id == batch_id).order_by(BatchPart.seq)))
    assert [(p.kind, p.line_count) for p in ps] == [("output", 9), ("errors", 1)]
    first = [json.loads(x) for x in store.read_bytes(ps[0].storage_uri, max_bytes=1 << 20).splitlines()]
    assert [x["custom_id"] for x in first] == [f"c{i - 1}" for i in range(1, 11) if i != 4]
    assert parts.flush(factory, store, batch_id) == 0  # nothing new: no empty part


def test_a_flush_killed_before_its_commit_loses_and_duplicates_nothing(db, store, factory):
    batch_id = _batch(db, store)
    _answer(factory, batch_id, range(1, 6))
    # The object is written, then the process dies before the commit: the transaction rolls back.
    with factory() as s:
        s.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())
        assert parts.flush_in(s, store, batch_id) == 5
        s.rollback()
    with factory() as s:
        assert parts.check(s, batch_id) == parts.PartsCheck(5, 0, 0, True)
    assert store.exists(store.uri(parts.part_key(batch_id, 1)))  # the orphan, rewritten by the next flush
    _answer(factory, batch_id, range(6, 9))
    assert parts.flush(factory, store, batch_id) == 8
    _answer(factory, batch_id, range(9, N + 1))
    assert checkpoint.finalize(factory, store, batch_id) == BatchStatus.COMPLETED
    db.expire_all()
    b = db.get(Batch, batch_id)
    out = _lines(store, db, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"c{i}" for i in range(N)) and b.error_file_id is None
    rows = list(db.scalars(select(UsageEvent.request_id).where(UsageEvent.request_id.like(f"batch_req_{batch_id.hex}_%"))))
    assert sorted(rows) == sorted(x["id"] for x in out)  # one ledger row per line in the file
    with factory() as s:
        c = parts.check(s, batch_id)
    assert c.unflushed == 0 and c.in_parts == N and c.counts_agree
    assert not store.exists(store.uri(parts.part_key(batch_id, 1)))  # the parts went once the files were made


def test_cancel_keeps_every_answered_line_and_skips_the_rest(db, store, factory):
    batch_id = _batch(db, store)
    _answer(factory, batch_id, range(1, 8), failed={2})
    parts.flush(factory, store, batch_id)
    _answer(factory, batch_id, range(8, 11))  # answered, not flushed yet when the cancel comes
    db.execute(update(Batch).where(Batch.id == batch_id).values(status=BatchStatus.CANCELLING))
    db.commit()
    assert checkpoint.finalize(factory, store, batch_id) == BatchStatus.CANCELLED
    assert checkpoint.finalize(factory, store, batch_id) == BatchStatus.CANCELLED  # idempotent
    db.expire_all()
    b = db.get(Batch, batch_id)
    out, err = _lines(store, db, b.output_file_id), _lines(store, db, b.error_file_id)
    assert sorted(int(x["custom_id"][1:]) + 1 for x in out) == [1, 3, 4, 5, 6, 7, 8, 9, 10]
    skipped = [x for x in err if x["response"] is None]
    assert len(err) == 1 + N - 10 and len(skipped) == N - 10
    assert all(x["error"]["code"] == "batch_cancelled" for x in skipped)
    with factory() as s:
        assert parts.check(s, batch_id) == parts.PartsCheck(0, N, 4, True)
