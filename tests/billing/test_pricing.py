"""The gateway's Pricer: `Pricer(session_factory).price_record(rec) -> int` micro-USD on a UsageRecord,
from an in-process price book that refreshes in the background."""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone

from services.billing.pricing import Pricer
from services.gateway.metering import UsageRecord
from tests.billing.conftest import make_contract, make_price
from tests.factories import make_adapter, make_adapter_version, make_tenant, unique


def record(tenant_id, *, prompt=1000, cached=400, completion=250, adapter_version_id=None, at=None) -> UsageRecord:
    return UsageRecord(
        request_id=f"req_{uuid.uuid4().hex}", tenant_id=tenant_id, api_key_id=None, model="mplex-demo", base_model="mplex-demo",
        adapter_version_id=adapter_version_id, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
        status="ok", http_status=200, created_at=at or datetime.now(timezone.utc),
    )


def test_prices_a_usage_record(db, session_factory):
    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    version = make_adapter_version(db, adapter=make_adapter(db, tenant=tenant))
    discounted = make_tenant(db, plan=plan)
    make_contract(db, tenant=discounted, discount_bps=2000)
    pricer = Pricer(session_factory)
    assert pricer.price_record(record(tenant.id)) == 310  # 600 x 0.2 + 400 x 0.1 + 250 x 0.6
    assert pricer.price_record(record(tenant.id, adapter_version_id=version.id)) == 373  # + 1250 x 0.05, 372.5 half up
    assert pricer.price_record(record(discounted.id)) == 248  # 20% off 310
    newcomer = make_tenant(db, plan=plan)
    assert pricer.price_record(record(newcomer.id)) == 310  # created after the cache was filled: its plan is looked up


def test_unpriced_or_unknown_is_zero_not_an_error(db, session_factory):
    tenant = make_tenant(db, plan=unique("no-prices"))
    pricer = Pricer(session_factory)
    assert pricer.price_record(record(tenant.id)) == 0
    assert pricer.price_record(record(uuid.uuid4())) == 0


def test_price_changes_reach_the_cache_after_its_ttl(db, session_factory):
    plan = unique("plan")
    make_price(db, plan=plan, input=1_000_000, cached_input=0, output=0)
    tenant = make_tenant(db, plan=plan)
    pricer = Pricer(session_factory, ttl_s=0.2)
    rec = record(tenant.id, prompt=1000, cached=0, completion=0, at=datetime.now(timezone.utc) - timedelta(minutes=1))
    assert pricer.price_record(rec) == 1000
    make_price(db, plan=plan, effective_from=datetime.now(timezone.utc) - timedelta(seconds=1), input=3_000_000,
               cached_input=0, output=0)
    assert pricer.price_record(record(tenant.id, prompt=1000, cached=0, completion=0, at=datetime.now(timezone.utc))) in (1000, 3000)
    deadline = time.time() + 10
    while time.time() < deadline:  # the refresh runs on a background thread; the stale snapshot answers meanwhile
        if pricer.price_record(record(tenant.id, prompt=1000, cached=0, completion=0)) == 3000:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the new price never reached the cache")
    assert pricer.price_record(rec) == 1000  # an event before the change keeps its price
