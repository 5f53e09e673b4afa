"""API key authentication under a burst: concurrent requests with one key share one fetch (Redis, then the
database), so a tenant's burst on a cold cache runs one query -- not one per request, ahead of every other
tenant's first request -- and a caller that hangs up does not fail the others."""
from __future__ import annotations

import asyncio

import pytest

from services.common.errors import AuthenticationError
from tests.factories import make_api_key, make_key_auth, make_tenant


def test_a_burst_with_one_key_runs_one_lookup_and_a_hung_up_caller_fails_nobody(db, database_url, service_urls, redis_client):
    key = make_api_key(db, tenant=make_tenant(db))

    async def main():
        auth = make_key_auth(database_url, service_urls.redis_url)
        lookups = []
        original = auth._lookup

        def counted(parsed):
            lookups.append(parsed.prefix)
            return original(parsed)

        auth._lookup = counted
        header = f"Bearer {key.secret}"
        leader = asyncio.create_task(auth.authenticate(header))
        await asyncio.sleep(0)  # the leader's fetch is in flight
        others = [asyncio.create_task(auth.authenticate(header)) for _ in range(50)]
        leader.cancel()  # the first caller hangs up: the shared fetch goes on for the others
        principals = await asyncio.gather(*others)
        assert len(lookups) == 1 and len({p.key_id for p in principals}) == 1
        assert not auth._fetching  # nothing left in flight
        with pytest.raises(AuthenticationError):  # a wrong secret is its own fetch, and refused
            await auth.authenticate(f"Bearer {key.secret[:-4]}xxxx")
        await auth.redis.aclose()

    redis_client.flushdb()
    asyncio.run(main())


def test_the_gateway_opens_its_redis_connections_before_the_first_burst(service_urls):
    """A burst on a cold pool opens a connection per concurrent command on the event loop (seconds, under load,
    with every request's key check and reservation waiting); the gateway opens them at start-up instead."""
    from services.gateway.state import make_redis, warm_redis_pool

    async def main():
        redis = make_redis(service_urls.redis_url)
        pool = redis.connection_pool
        assert len(pool._available_connections) == 0
        await warm_redis_pool(redis, 16)
        warmed = len(pool._available_connections)
        await asyncio.gather(*(redis.ping() for _ in range(16)))  # a burst of 16: served by the warm ones
        after = len(pool._available_connections)
        await redis.aclose()
        return warmed, after

    warmed, after = asyncio.run(main())
    assert warmed == 16 and after == 16


def test_a_gateway_whose_redis_is_down_still_starts():
    from services.gateway.state import make_redis, warm_redis_pool

    async def main():
        redis = make_redis("redis://127.0.0.1:9/0")  # nothing listens on the discard port
        await warm_redis_pool(redis, 4)  # logs, does not raise
        await redis.aclose()

    asyncio.run(main())
