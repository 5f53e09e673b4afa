"""The engine-time sampler: registry snapshots -> contiguous busy/idle windows, idempotent, restart-aware."""
from __future__ import annotations

import time

import orjson
from sqlalchemy import select

from services.billing.engines import EngineSample, read_registry, record_sample, sample_engines, to_us
from services.common.models import EngineUsageReport
from services.common.engine_registry import REGISTRY_SET, entry_key
from tests.factories import unique

T = 1_700_000_000_000_000  # an engine start, epoch microseconds


def windows(db, engine_id: str) -> list[EngineUsageReport]:
    db.expire_all()
    rows = db.scalars(select(EngineUsageReport).where(EngineUsageReport.engine_id == engine_id).order_by(EngineUsageReport.window_start)).all()
    db.commit()
    return list(rows)


def test_windows_tile_the_engine_life_and_split_busy_from_idle(db):
    e = unique("eng")
    w1 = record_sample(db, EngineSample(e, "cpu", "m", T, wall_us=10_000_000, busy_us=4_000_000))
    w2 = record_sample(db, EngineSample(e, "cpu", "m", T, wall_us=25_000_000, busy_us=4_500_000))
    assert (w1.busy_us, w1.idle_us) == (4_000_000, 6_000_000)
    assert (w2.busy_us, w2.idle_us) == (500_000, 14_500_000)
    rows = windows(db, e)
    assert [to_us(r.window_start) - T for r in rows] == [0, 10_000_000]
    assert rows[0].window_end == rows[1].window_start
    assert sum(r.busy_us + r.idle_us for r in rows) == 25_000_000
    assert all(r.engine_type == "cpu" and r.base_model == "m" for r in rows)


def test_resent_or_stale_samples_change_nothing(db):
    e = unique("eng")
    record_sample(db, EngineSample(e, "cpu", None, T, 10_000_000, 1_000_000))
    assert record_sample(db, EngineSample(e, "cpu", None, T, 10_000_000, 1_000_000)) is None  # no time passed
    assert record_sample(db, EngineSample(e, "cpu", None, T, 9_000_000, 900_000)) is None  # an older snapshot
    assert len(windows(db, e)) == 1


def test_busy_never_exceeds_a_window_and_the_excess_carries_over(db):
    e = unique("eng")
    # A snapshot whose busy counter ran ahead of its wall clock (rounding, or read between a step's end and
    # its bookkeeping): the window is all busy, the rest lands in the next window.
    w1 = record_sample(db, EngineSample(e, "cpu", None, T, 1_000_000, 1_200_000))
    w2 = record_sample(db, EngineSample(e, "cpu", None, T, 3_000_000, 1_500_000))
    assert (w1.busy_us, w1.idle_us) == (1_000_000, 0)
    assert (w2.busy_us, w2.idle_us) == (500_000, 1_500_000)
    assert sum(w.busy_us for w in windows(db, e)) == 1_500_000


def test_a_restarted_engine_starts_a_new_accounting(db):
    e = unique("eng")
    record_sample(db, EngineSample(e, "cpu", None, T, 60_000_000, 30_000_000))
    restarted = T + 120_000_000  # same id, started again two minutes after the first start
    w = record_sample(db, EngineSample(e, "H100", None, restarted, 5_000_000, 1_000_000))
    assert to_us(w.window_start) == restarted and (w.busy_us, w.idle_us) == (1_000_000, 4_000_000)
    assert [r.engine_type for r in windows(db, e)] == ["cpu", "H100"]


def test_sampling_the_registry(db, session_factory, redis_client, service_urls):
    import redis

    a, b, old = unique("eng-a"), unique("eng-b"), unique("eng-old")
    now = time.time()
    snaps = {
        a: {"id": a, "engine_type": "cpu", "base_model": "m", "started_at": now - 20, "wall_s": 20.0, "busy_s": 5.0},
        b: {"id": b, "engine_type": "H100", "base_model": "m", "started_at": now - 8, "wall_s": 8.0, "busy_s": 8.0},
        old: {"id": old, "base_model": "m"},  # an engine build without time accounting: skipped
    }
    for k, v in snaps.items():
        redis_client.set(entry_key(k), orjson.dumps(v), ex=30)
        redis_client.sadd(REGISTRY_SET, k)
    client = redis.Redis.from_url(service_urls.redis_url)  # bytes replies, as the billing task uses it
    try:
        mine = {s.engine_id: s for s in read_registry(client) if s.engine_id in snaps}
        assert set(mine) == {a, b}
        assert (mine[a].wall_us, mine[a].busy_us) == (20_000_000, 5_000_000)
        got = {w.engine_id: w for w in sample_engines(session_factory, client) if w.engine_id in snaps}
        assert (got[a].busy_us, got[a].idle_us) == (5_000_000, 15_000_000)
        assert (got[b].busy_us, got[b].idle_us) == (8_000_000, 0)
        again = {w.engine_id: w for w in sample_engines(session_factory, client) if w.engine_id in snaps}
        assert again == {}  # same snapshots: nothing new
    finally:
        for k in snaps:
            redis_client.delete(entry_key(k))
            redis_client.srem(REGISTRY_SET, k)
        client.close()

