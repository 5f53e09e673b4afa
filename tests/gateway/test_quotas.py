"""Quota windows in real Redis: atomic reservation under concurrency, exact settlement, TTLs, headers."""
from __future__ import annotations

import asyncio
import uuid
from datetime import datetime

import pytest
import redis.asyncio as aioredis

from services.gateway.quotas import (
    CONCURRENT_RETRY_S,
    MINUTE_TTL_S,
    RESERVATION_TTL_S,
    Limits,
    QuotaExceeded,
    QuotaUnavailable,
    Quotas,
    Scope,
    window_end,
)
from services.gateway.state import make_redis


@pytest.fixture
def prefix() -> str:
    return f"qt{uuid.uuid4().hex[:8]}"


def run(coro):
    return asyncio.run(coro)


async def _quotas(url: str, prefix: str, **kw) -> Quotas:
    return Quotas(make_redis(url, max_connections=32), prefix=prefix, **kw)


async def _reserve_or_refusal(q: Quotas, request_id: str, scope: list[Scope], tokens: int, now: float):
    try:
        return await q.reserve(request_id, scope, tokens, now=now)
    except QuotaExceeded as exc:
        return exc


def test_concurrent_reservations_never_exceed_the_token_limit_and_settle_to_zero(service_urls, redis_client, prefix):
    limit = 10_000

    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "t1", Limits(tokens_per_min=limit, concurrent=50))]
        now = 1_800_000_000.0  # one fixed minute window for the whole test

        results = await asyncio.gather(*(_reserve_or_refusal(q, f"r{i}", scope, 137, now) for i in range(200)))
        admitted = [r for r in results if not isinstance(r, QuotaExceeded)]
        refused = [r for r in results if isinstance(r, QuotaExceeded)]
        assert 137 * len(admitted) <= limit
        assert {r.window for r in refused} <= {"tokens_per_min", "concurrent"}
        tpm_key = f"{prefix}:tenant:t1:tpm:{int(now // 60)}"
        assert int(await q.redis.get(tpm_key)) == 137 * len(admitted)
        assert await q.redis.zcard(f"{prefix}:tenant:t1:conc") == len(admitted)
        # Settle with actual usage (some used less); exactly once each.
        settled = await asyncio.gather(*(q.settle(r, 100) for r in admitted))
        assert all(settled)
        assert not any(await asyncio.gather(*(q.settle(r, 100) for r in admitted)))  # second settle is a no-op
        assert int(await q.redis.get(tpm_key)) == 100 * len(admitted)
        assert await q.redis.zcard(f"{prefix}:tenant:t1:conc") == 0
        assert await q.redis.keys(f"{prefix}:res:*") == []
        await q.redis.aclose()
        return len(admitted)

    admitted = run(main())
    assert admitted == 50  # the concurrency window (50) bound first
    for key in redis_client.keys(f"{prefix}:*"):
        assert redis_client.ttl(key) > 0, f"{key} has no TTL"


def test_token_window_refusal_carries_openai_headers(service_urls, prefix):
    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("key", "k1", Limits(tokens_per_min=1000, requests_per_min=5))]
        ok = await q.reserve("a", scope, 600, now=1_800_000_010.0)
        assert ok.headers["x-ratelimit-limit-tokens"] == "1000"
        assert ok.headers["x-ratelimit-remaining-tokens"] == "400"
        assert ok.headers["x-ratelimit-remaining-requests"] == "4"
        with pytest.raises(QuotaExceeded) as exc:
            await q.reserve("b", scope, 600, now=1_800_000_010.0)
        e = exc.value
        assert e.window == "tokens_per_min" and e.scope == "key" and not e.is_budget
        assert int(e.headers["retry-after"]) >= 1
        assert e.headers["x-ratelimit-remaining-tokens"] == "400"
        await q.redis.aclose()

    run(main())


def test_tenant_and_key_windows_both_apply(service_urls, prefix):
    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        tenant = Scope("tenant", "t", Limits(requests_per_min=3))
        await q.reserve("k1-1", [tenant, Scope("key", "k1", Limits())], 1, now=1_800_000_100.0)
        await q.reserve("k1-2", [tenant, Scope("key", "k1", Limits())], 1, now=1_800_000_100.0)
        await q.reserve("k2-1", [tenant, Scope("key", "k2", Limits())], 1, now=1_800_000_100.0)
        with pytest.raises(QuotaExceeded) as exc:  # another key of the same tenant: the tenant window is full
            await q.reserve("k3-1", [tenant, Scope("key", "k3", Limits())], 1, now=1_800_000_100.0)
        assert exc.value.scope == "tenant" and exc.value.window == "requests_per_min"
        await q.redis.aclose()

    run(main())


def test_monthly_budget_is_insufficient_quota_and_seeds_from_the_ledger(service_urls, prefix):
    seeded = []

    async def month_usage(kind, scope_id):
        seeded.append((kind, scope_id))
        return 900

    async def main():
        q = await _quotas(service_urls.redis_url, prefix, month_usage=month_usage)
        scope = [Scope("tenant", "tb", Limits(monthly_tokens=1000))]
        await q.reserve("m1", scope, 50, now=1_800_000_200.0)  # 900 (ledger) + 50
        with pytest.raises(QuotaExceeded) as exc:
            await q.reserve("m2", scope, 60, now=1_800_000_200.0)
        assert exc.value.is_budget
        await q.redis.aclose()

    run(main())
    assert seeded == [("tenant", "tb")]  # the counter is seeded once, then lives in Redis


def test_refused_reservation_changes_nothing(service_urls, redis_client, prefix):
    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "x", Limits(tokens_per_min=100, requests_per_min=10))]
        with pytest.raises(QuotaExceeded):
            await q.reserve("big", scope, 101, now=1_800_000_300.0)
        await q.redis.aclose()

    run(main())
    assert redis_client.get(f"{prefix}:tenant:x:tpm:{int(1_800_000_300 // 60)}") is None
    assert redis_client.get(f"{prefix}:tenant:x:rpm:{int(1_800_000_300 // 60)}") is None


def test_redis_down_fails_closed_by_default_and_open_when_configured(prefix):
    dead = "redis://127.0.0.1:1/0"

    async def main(fail_open: bool):
        q = Quotas(aioredis.from_url(dead, socket_connect_timeout=0.5), prefix=prefix, fail_open=fail_open)
        try:
            return await q.reserve("r", [Scope("tenant", "t", Limits(tokens_per_min=10))], 1)
        finally:
            await q.redis.aclose()

    with pytest.raises(QuotaUnavailable):
        run(main(False))
    assert run(main(True)).enforced is False


MINUTE = 1_800_000_000 // 60 * 60  # an exact minute boundary (epoch seconds)


@pytest.mark.parametrize("offset, expected, reset", [
    (0.0, 60, "1m0s"), (0.4, 60, "1m0s"), (3.5, 57, "57s"), (30.0, 30, "30s"), (56.2, 4, "4s"), (59.9, 1, "100ms"),
])
def test_retry_after_is_the_time_to_the_end_of_the_refusing_minute(service_urls, redis_client, prefix, offset, expected,
                                                                   reset):
    """Not the counter key's TTL (it lives 120 s so the usage API can read the last window)."""
    now = MINUTE + offset

    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        tokens = [Scope("key", "kt", Limits(tokens_per_min=100))]
        requests = [Scope("key", "kr", Limits(requests_per_min=1))]
        await q.reserve("t1", tokens, 100, now=now)
        await q.reserve("r1", requests, 1, now=now)
        refused = []
        for rid, scope in (("t2", tokens), ("r2", requests)):
            with pytest.raises(QuotaExceeded) as exc:
                await q.reserve(rid, scope, 1, now=now)
            refused.append(exc.value)
        await q.redis.aclose()
        return refused

    by_tokens, by_requests = run(main())
    assert by_tokens.window == "tokens_per_min" and by_requests.window == "requests_per_min"
    for e, unit in ((by_tokens, "tokens"), (by_requests, "requests")):
        assert e.retryable and e.needed == 1
        assert int(e.headers["retry-after"]) == expected
        assert e.retry_after_s == pytest.approx(60 - offset)
        assert e.headers[f"x-ratelimit-reset-{unit}"] == reset
        assert f"Retry after {expected}s" in e.message
    # The window keys keep their layout and TTL: other readers (the tenant usage API) depend on them.
    assert 60 < redis_client.ttl(f"{prefix}:key:kt:tpm:{MINUTE // 60}") <= MINUTE_TTL_S


@pytest.mark.parametrize("now_iso, expected_s", [
    ("2027-01-31T23:59:00+00:00", 60),  # a minute before February
    ("2027-02-14T12:00:00+00:00", 14 * 86400 + 12 * 3600),  # to March 1st (28-day February)
    ("2026-12-31T23:59:59.5+00:00", 1),  # December rolls over into next year's January
])
def test_budget_retry_after_is_the_start_of_next_month_utc(service_urls, prefix, now_iso, expected_s):
    now = datetime.fromisoformat(now_iso).timestamp()

    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "tm", Limits(monthly_tokens=100))]
        await q.reserve("m1", scope, 90, now=now)
        with pytest.raises(QuotaExceeded) as exc:
            await q.reserve("m2", scope, 20, now=now)
        await q.redis.aclose()
        return exc.value

    e = run(main())
    assert e.is_budget and e.retryable
    assert int(e.headers["retry-after"]) == expected_s
    assert window_end("monthly_tokens", now) - now == pytest.approx(expected_s, abs=0.5)


def test_a_request_holds_one_concurrent_unit_per_sequence_and_settle_frees_them_all(service_urls, redis_client, prefix):
    now = MINUTE + 10.0
    conc = f"{prefix}:tenant:tc:conc"

    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "tc", Limits(concurrent=5, requests_per_min=100))]
        three = await q.reserve("three", scope, 30, now=now, concurrency=3)
        assert await q.redis.zcard(conc) == 3
        with pytest.raises(QuotaExceeded) as exc:  # 3 held + 3 > 5: busy now, fits once "three" settles
            await q.reserve("again", scope, 30, now=now, concurrency=3)
        busy = exc.value
        two = await q.reserve("two", scope, 20, now=now, concurrency=2)
        assert await q.redis.zcard(conc) == 5
        assert await q.settle(three, 12) is True
        assert await q.redis.zcard(conc) == 2
        assert await q.settle(three, 12) is False  # exactly once: a second settle releases nothing more
        assert await q.redis.zcard(conc) == 2
        assert await q.settle(two, 8) is True
        assert await q.redis.zcard(conc) == 0
        rpm = int(await q.redis.get(f"{prefix}:tenant:tc:rpm:{int(now // 60)}"))
        await q.redis.aclose()
        return busy, rpm

    busy, rpm = run(main())
    assert busy.window == "concurrent" and busy.retryable
    assert (busy.limit, busy.current, busy.needed) == (5, 3, 3)
    assert busy.headers == {"retry-after": "1"} and busy.retry_after_s == CONCURRENT_RETRY_S
    assert "limit 5, in use 3, this request needs 3" in busy.message
    assert rpm == 2  # requests/min counts HTTP requests, not sequences
    assert redis_client.keys(f"{prefix}:res:*") == []


def test_more_sequences_than_the_concurrency_limit_is_refused_for_good(service_urls, redis_client, prefix):
    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        tenant = Scope("tenant", "tn", Limits(concurrent=4, tokens_per_min=10_000))
        with pytest.raises(QuotaExceeded) as conc:  # an idle tenant: waiting would not help
            await q.reserve("hundred", [tenant, Scope("key", "kn", Limits())], 100, now=MINUTE, concurrency=100)
        with pytest.raises(QuotaExceeded) as tokens:
            await q.reserve("huge", [tenant], 10_001, now=MINUTE)
        await q.redis.aclose()
        return conc.value, tokens.value

    conc, tokens = run(main())
    assert (conc.window, conc.scope, conc.limit, conc.needed, conc.retryable) == ("concurrent", "tenant", 4, 100, False)
    assert "retry-after" not in conc.headers and conc.headers["x-should-retry"] == "false"
    assert "can never be admitted" in conc.message and "fewer prompts or a smaller n" in conc.message
    assert (tokens.window, tokens.needed, tokens.retryable) == ("tokens_per_min", 10_001, False)
    assert "retry-after" not in tokens.headers and tokens.headers["x-ratelimit-limit-tokens"] == "10000"
    assert "max_tokens" in tokens.message
    assert redis_client.keys(f"{prefix}:*") == []  # refused before anything was counted


def test_a_dead_holder_releases_all_its_units_when_its_reservation_expires(service_urls, redis_client, prefix):
    conc = f"{prefix}:tenant:td:conc"

    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "td", Limits(concurrent=6))]
        await q.reserve("dead", scope, 10, now=MINUTE, concurrency=6)  # its gateway dies: never settled
        with pytest.raises(QuotaExceeded):
            await q.reserve("blocked", scope, 10, now=MINUTE + 60, concurrency=1)
        later = MINUTE + RESERVATION_TTL_S + 1
        alive = await q.reserve("alive", scope, 10, now=later, concurrency=6)
        members = sorted(m.decode() for m in await q.redis.zrange(conc, 0, -1))
        assert await q.settle(alive, 10) is True
        left = await q.redis.zcard(conc)
        await q.redis.aclose()
        return members, left

    members, left = run(main())
    assert members == ["alive"] + [f"alive#{i}" for i in range(1, 6)]
    assert left == 0


def test_a_wide_request_reserves_and_releases_thousands_of_units(service_urls, prefix):
    """Units are added and removed in chunks (Lua's unpack() is bounded by its stack)."""
    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "tw", Limits(concurrent=5000))]
        conc = f"{prefix}:tenant:tw:conc"
        wide = await q.reserve("wide", scope, 1, now=MINUTE, concurrency=4321)
        held = await q.redis.zcard(conc)
        assert await q.settle(wide, 1) is True
        left = await q.redis.zcard(conc)
        await q.redis.aclose()
        return held, left

    assert run(main()) == (4321, 0)


def test_concurrency_must_be_positive(service_urls, prefix):
    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        try:
            with pytest.raises(ValueError):
                await q.reserve("zero", [Scope("tenant", "tz", Limits(concurrent=1))], 1, now=MINUTE, concurrency=0)
        finally:
            await q.redis.aclose()

    run(main())


def test_reserves_of_one_moment_share_a_round_trip_and_survive_a_lost_script_cache(service_urls, redis_client, prefix):
    """Concurrent reserves go to Redis as one pipeline (Quotas._flush_reserves): each still gets its own answer --
    here admitted up to the concurrency limit and refused after --, also when Redis has lost its scripts (a
    restart) between two batches: the batch is sent again with the script reloaded."""
    now = MINUTE + 5.0
    conc = f"{prefix}:tenant:tb:conc"

    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "tb", Limits(concurrent=7, requests_per_min=1000))]
        first = await q.reserve("warm", scope, 1, now=now)  # loads the script
        await q.settle(first, 1)
        await q.redis.script_flush()

        results = await asyncio.gather(*(_reserve_or_refusal(q, f"b{i}", scope, 10, now) for i in range(20)))
        held = await q.redis.zcard(conc)
        await asyncio.gather(*(q.settle(r, 3) for r in results if not isinstance(r, QuotaExceeded)))
        after = await q.redis.zcard(conc)
        await q.redis.aclose()
        return results, held, after

    results, held, after = run(main())
    admitted = [r for r in results if not isinstance(r, QuotaExceeded)]
    assert len(admitted) == 7 and held == 7 and after == 0
    assert {r.window for r in results if isinstance(r, QuotaExceeded)} == {"concurrent"}
    assert [r.request_id for r in admitted] == [f"b{i}" for i in range(7)]  # in the order they were asked


def test_a_reserve_cancelled_while_its_batch_runs_is_released(service_urls, redis_client, prefix):
    """A request whose client hangs up while its reservation is in flight must not hold the tenant's concurrency
    and tokens until the reservation's hour-long TTL: the batch releases what it reserved for nobody."""
    now = MINUTE + 7.0
    conc, tpm = f"{prefix}:tenant:tx:conc", f"{prefix}:tenant:tx:tpm:{int((MINUTE + 7.0) // 60)}"

    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "tx", Limits(concurrent=3, tokens_per_min=10_000))]
        kept = asyncio.ensure_future(q.reserve("kept", scope, 40, now=now))
        gone = asyncio.ensure_future(q.reserve("gone", scope, 50, now=now))
        await asyncio.sleep(0)  # both queued for the same batch
        gone.cancel()
        reservation = await kept
        with pytest.raises(asyncio.CancelledError):
            await gone
        for _ in range(100):  # the release is a settle of its own, right after the batch
            if await q.redis.zcard(conc) == 1:
                break
            await asyncio.sleep(0.01)
        state = (await q.redis.zcard(conc), int(await q.redis.get(tpm)), await q.redis.exists(f"{prefix}:res:gone"))
        await q.settle(reservation, 40)
        await q.redis.aclose()
        return state

    assert run(main()) == (1, 40, 0)
