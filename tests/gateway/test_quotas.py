"""Quota windows in real Redis: atomic reservation under concurrency, exact settlement, TTLs, headers."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from services.gateway.quotas import Limits, QuotaExceeded, QuotaUnavailable, Quotas, Scope
from services.gateway.state import make_redis


@pytest.fixture
def prefix() -> str:
    return f"qt{uuid.uuid4().hex[:8]}"


def run(coro):
    return asyncio.run(coro)


async def _quotas(url: str, prefix: str, **kw) -> Quotas:
    return Quotas(make_redis(url, max_connections=32), prefix=prefix, **kw)


def test_concurrent_reservations_never_exceed_the_token_limit_and_settle_to_zero(service_urls, redis_client, prefix):
    limit = 10_000

    async def main():
        q = await _quotas(service_urls.redis_url, prefix)
        scope = [Scope("tenant", "t1", Limits(tokens_per_min=limit, concurrent=50))]
        now = 1_800_000_000.0  # one fixed minute window for the whole test

        async def one(i: int):
            try:
                return await q.reserve(f"r{i}", scope, 137, now=now)
            except QuotaExceeded as exc:
                return exc

        results = await asyncio.gather(*(one(i) for i in range(200)))
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
