"""Billing at scale: a month of 1,000,000 ledger events rolled up and exported as the finance report.

A scratch database (embedded Postgres unless MPLEX_DATABASE_URL is set) is migrated, seeded with 50 tenants
on 3 plans (mid-month price change, contracts for some), 2 adapters each, 4 engines reporting busy/idle every
minute, and 1M events bulk-loaded with COPY. Timed: the first roll-up of the whole month, the export (CSV +
JSON), a re-run of both (no change; bytes identical), issuing the month's statements, and (first) the same
report before any roll-up, every day computed live from the ledger.
Target: roll-up + export <= 60 s.
"""
from __future__ import annotations

import os
import random
import time
import uuid
from datetime import date, datetime, timedelta, timezone

from bench.common import Target, table, write_results

N_EVENTS = int(os.environ.get("MPLEX_BENCH_BILLING_EVENTS", "1000000"))
N_TENANTS = 50
MONTH = date(2025, 1, 1)
ENGINES = (("bench-h100-0", "H100"), ("bench-h100-1", "H100"), ("bench-cpu-0", "cpu"), ("bench-cpu-1", "cpu"))
TARGET_S = 60.0


def _database():
    """A fresh database on the configured or embedded server; returns (url, drop())."""
    from sqlalchemy import make_url, text

    from services.common.db import make_db_engine
    from services.common.embedded import resolve_urls
    from services.common.settings import Settings

    server = make_url(resolve_urls(Settings()).database_url)
    admin = make_db_engine(server.set(database="postgres").render_as_string(hide_password=False), pool_size=1, max_overflow=0,
                        isolation_level="AUTOCOMMIT")
    name = f"mplex_bench_billing_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return server.set(database=name).render_as_string(hide_password=False), drop


def _seed(session) -> tuple[list, list]:
    """Tenants, adapters, price book, engine prices; returns (tenant ids, [(tenant id, version id, name)])."""
    from services.billing.pricebook import set_engine_price, set_list_price
    from services.common.models import Adapter, AdapterVersion, BaseModelRecord, Tenant, TenantPriceOverride

    start = datetime.combine(MONTH, datetime.min.time(), timezone.utc)
    base = BaseModelRecord(name="mplex-demo", uri="file:///bench", params={})
    session.add(base)
    session.flush()
    for i, plan in enumerate(("default", "pro", "enterprise")):
        set_list_price(session, base_model="mplex-demo", plan=plan, effective_from=start - timedelta(days=400),
                       input=200_000 - 40_000 * i, cached_input=100_000 - 20_000 * i, output=600_000 - 100_000 * i, adapter_surcharge=50_000)
        set_list_price(session, base_model="mplex-demo", plan=plan, effective_from=start + timedelta(days=15),
                       input=180_000 - 40_000 * i, cached_input=90_000 - 20_000 * i, output=550_000 - 100_000 * i, adapter_surcharge=40_000)
    set_engine_price(session, name="H100", effective_from=start - timedelta(days=400), price_per_hour=2_500_000)
    set_engine_price(session, name="cpu", effective_from=start - timedelta(days=400), price_per_hour=400_000)
    tenants, versions = [], []
    for t in range(N_TENANTS):
        tenant = Tenant(name=f"Bench tenant {t:02d}", slug=f"bench-{t:02d}", plan=("default", "pro", "enterprise")[t % 3])
        session.add(tenant)
        session.flush()
        tenants.append(tenant.id)
        if t % 5 == 0:
            session.add(TenantPriceOverride(tenant_id=tenant.id, base_model=None, effective_from=start - timedelta(days=30),
                                            discount_bps=1500, note="bench contract"))
        for a in range(2):
            ad = Adapter(tenant_id=tenant.id, name=f"adapter-{a}", base_model_id=base.id)
            session.add(ad)
            session.flush()
            v = AdapterVersion(adapter_id=ad.id, tenant_id=tenant.id, version=1, base_model_id=base.id,
                               content_sha256=uuid.uuid4().hex * 2, storage_uri="file:///bench", size_bytes=1)
            session.add(v)
            session.flush()
            versions.append((tenant.id, v.id, ad.name))
    session.commit()
    return tenants, versions


def _load_events(url: str, tenants: list, versions: list) -> float:
    """COPY N_EVENTS ledger rows spread over the month, plus a month of engine reports. Returns seconds."""
    import psycopg

    rng = random.Random(42)
    start = datetime.combine(MONTH, datetime.min.time(), timezone.utc)
    month_s = 31 * 86400
    by_tenant: dict = {}
    for tid, vid, name in versions:
        by_tenant.setdefault(tid, []).append((vid, name))
    t0 = time.perf_counter()
    cols = ("request_id, tenant_id, model, base_model, adapter_version_id, prompt_tokens, cached_tokens, completion_tokens, "
            "status, http_status, created_at, engine_id, compute_us")
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        with conn.cursor() as cur, cur.copy(f"COPY usage_events ({cols}) FROM STDIN") as copy:
            for i in range(N_EVENTS):
                tid = tenants[int(rng.paretovariate(1.2)) % len(tenants)]  # a few big tenants, a long tail
                adapter = rng.random() < 0.6
                vid, name = by_tenant[tid][rng.randrange(2)] if adapter else (None, "mplex-demo")
                prompt = rng.randrange(20, 4000)
                cached = prompt * rng.randrange(0, 4) // 4
                completion = rng.randrange(1, 800)
                status = "ok" if rng.random() < 0.97 else "cancelled"
                engine_id = ENGINES[rng.randrange(len(ENGINES))][0]
                copy.write_row((f"req_bench_{i:09d}", tid, name, "mplex-demo", vid, prompt, cached, completion, status,
                                200 if status == "ok" else 499, start + timedelta(seconds=rng.random() * month_s), engine_id,
                                rng.randrange(1_000, 400_000)))
        with conn.cursor() as cur, cur.copy(
            "COPY engine_usage_reports (engine_id, engine_type, base_model, window_start, window_end, busy_us, idle_us) FROM STDIN"
        ) as copy:
            for engine_id, etype in ENGINES:
                for minute in range(31 * 24 * 60):
                    ws = start + timedelta(minutes=minute)
                    busy = rng.randrange(0, 60_000_000)
                    copy.write_row((engine_id, etype, "mplex-demo", ws, ws + timedelta(minutes=1), busy, 60_000_000 - busy))
        conn.commit()
        conn.execute("ANALYZE usage_events")
        conn.execute("ANALYZE engine_usage_reports")
    return time.perf_counter() - t0


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def main() -> None:
    from services.billing.config import BillingConfig
    from services.billing.reports import build_report, month_period, report_csv, report_json_bytes
    from services.billing.rollup import rollup_pending
    from services.billing.statements import issue_statements
    from services.common.db import make_db_engine, make_sessionmaker
    from services.common.migrate import upgrade

    url, drop = _database()
    engine = make_db_engine(url, pool_size=2, max_overflow=0)
    try:
        upgrade(url)
        factory = make_sessionmaker(engine)
        with factory() as s:
            tenants, versions = _seed(s)
        load_s = _load_events(url, tenants, versions)
        print(f"loaded {N_EVENTS:,} events + {len(ENGINES) * 31 * 1440:,} engine windows with COPY in {load_s:.1f}s", flush=True)

        config = BillingConfig(settle_lag_s=0.0)
        first, last = month_period(MONTH)
        with factory() as s:
            def export():
                rep = build_report(s, config, day_from=first, day_to=last)
                s.commit()
                return rep, report_csv(rep), report_json_bytes(rep)

            (_, live_csv, _), live_s = timed(export)  # before any roll-up: every day computed live
            r, rollup_s = timed(lambda: rollup_pending(s, config))
            (rep, csv_bytes, json_bytes), export_s = timed(export)
            again, rerun_rollup_s = timed(lambda: rollup_pending(s, config))
            (_, csv2, json2), rerun_export_s = timed(export)
            identical = csv2 == csv_bytes and json2 == json_bytes
            stmts, statements_s = timed(lambda: issue_statements(s, config, period=MONTH, today=date(2025, 3, 1)))
        assert rep.totals.requests == N_EVENTS, (rep.totals.requests, N_EVENTS)
        assert sum(x.total_micros for x in stmts if x.total_micros is not None) == rep.totals.billed_micros
        assert identical and again.changed == 0
        assert live_csv == csv_bytes, "a report from live days must equal the one from stored roll-ups"

        print(table("billing: 1 month", ["step", "seconds", "detail"], [
            ["report before roll-up (live)", live_s, "same bytes as after the roll-up"],
            ["roll-up (first run)", rollup_s, f"{len(r.days)} days, {r.rows} daily rows"],
            ["export csv + json", export_s, f"{len(rep.tenants)} tenants, {len(csv_bytes):,} + {len(json_bytes):,} bytes"],
            ["roll-up re-run", rerun_rollup_s, f"{again.changed} rows changed"],
            ["export re-run", rerun_export_s, "identical bytes" if identical else "DIFFERENT BYTES"],
            ["statements", statements_s, f"{len(stmts)} issued"],
        ]))
        write_results("billing", {
            "events": N_EVENTS, "tenants": N_TENANTS, "daily_rows": r.rows, "load_seconds": round(load_s, 3),
            "rollup_seconds": round(rollup_s, 3), "export_seconds": round(export_s, 3),
            "rerun_rollup_seconds": round(rerun_rollup_s, 3), "rerun_export_seconds": round(rerun_export_s, 3),
            "statements_seconds": round(statements_s, 3), "live_report_seconds": round(live_s, 3), "rerun_identical": identical,
            "billed_microusd": rep.totals.billed_micros, "compute_cost_microusd": rep.totals.compute_cost_micros,
            "unallocated_cost_microusd": rep.engines.idle_cost_micros,
        }, [Target("rollup+export seconds", rollup_s + export_s, TARGET_S, higher_is_better=False)])
    finally:
        engine.dispose()
        drop()


if __name__ == "__main__":
    main()
