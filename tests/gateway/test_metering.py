"""Exactly-once metering: idempotent ledger inserts, a durable spool while Postgres is down, replay."""
from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timezone

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from services.common.db import make_db_engine, make_sessionmaker
from services.common.models import UsageEvent
from services.gateway.metering import Meter, UsageRecord
from services.gateway.spool import Spool
from tests.factories import make_tenant


def _record(tenant_id, rid: str, completion: int = 7) -> UsageRecord:
    return UsageRecord(
        request_id=rid, tenant_id=tenant_id, api_key_id=None, model="mplex-demo", base_model="mplex-demo",
        adapter_version_id=None, prompt_tokens=11, cached_tokens=3, completion_tokens=completion, status="ok",
        http_status=200, created_at=datetime.now(timezone.utc), client_request_id="client-1", compute_us=1234,
    )


def _count(db, tenant_id) -> int:
    return db.execute(select(func.count()).select_from(UsageEvent).where(UsageEvent.tenant_id == tenant_id)).scalar_one()


def test_record_lands_once_even_if_sent_twice(db, database_url, tmp_path):
    tenant = make_tenant(db)
    meter = Meter(make_sessionmaker(make_db_engine(database_url)), tmp_path / "spool")
    rec = _record(tenant.id, f"req-{uuid.uuid4().hex}")
    assert asyncio.run(meter.record(rec)) == "ledger"
    assert asyncio.run(meter.record(rec)) == "ledger"
    assert _count(db, tenant.id) == 1
    row = db.execute(select(UsageEvent).where(UsageEvent.request_id == rec.request_id)).scalar_one()
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.compute_us, row.client_request_id) == (11, 3, 7, 1234, "client-1")


def test_postgres_down_spools_durably_and_replay_lands_each_event_exactly_once(db, database_url, tmp_path):
    tenant = make_tenant(db)
    down = make_sessionmaker(make_db_engine("postgresql://postgres@127.0.0.1:1/none"))
    meter = Meter(down, tmp_path / "spool")
    recs = [_record(tenant.id, f"req-{uuid.uuid4().hex}", completion=i) for i in range(5)]
    for rec in recs:
        assert asyncio.run(meter.record(rec)) == "spool"
    assert meter.spool.depth() == 5
    with pytest.raises(OperationalError):
        meter.replay_once()  # still down: nothing is lost, files stay
    assert meter.spool.depth() == 5
    up = Meter(make_sessionmaker(make_db_engine(database_url)), tmp_path / "spool")
    assert asyncio.run(up.record(recs[0])) == "ledger"  # one event already landed directly: no double count
    assert up.replay_once() == 5
    assert up.spool.depth() == 0 and up.replay_once() == 0
    assert _count(db, tenant.id) == 5
    total = db.execute(select(func.sum(UsageEvent.completion_tokens)).where(UsageEvent.tenant_id == tenant.id)).scalar_one()
    assert total == sum(range(5))


def test_spool_tolerates_a_torn_last_line_but_not_corruption(tmp_path):
    spool = Spool(tmp_path)
    spool.append({"a": 1})
    with open(spool.active, "ab") as f:
        f.write(b'{"a": 2')  # a crash mid-append
    got: list[dict] = []
    assert spool.replay(lambda batch: got.extend(batch)) == 1 and got == [{"a": 1}]
    spool.append({"b": 1})
    with open(spool.active, "ab") as f:
        f.write(b"garbage\n")
    spool.append({"b": 2})
    with pytest.raises(ValueError, match="corrupt spool line"):
        spool.replay(lambda batch: None)
