"""A Redis that answers late (a busy shared host, a failover; on the 2-core bench machine, an embedded Redis
waiting for a core) must not hold the requests that arrive meanwhile: the gateway's per-request lookups --
the API key's principal and the live engines -- are served from what it already holds while one refresh
runs in the background, and wait only when what they hold is too old to trust or names nothing.

The Redis here is real and really stalled: `CLIENT PAUSE` stops it answering anyone for a while. Each test
asserts an order, not a time: the lookup finished while a PING sent before it was still unanswered."""
from __future__ import annotations

import asyncio

import pytest

from services.common.engine_registry import REGISTRY_SET, EngineSnapshot, entry_key
from tests.factories import make_api_key, make_key_auth, make_tenant

# Under the client's 2 s socket timeout. (Redis 6.2 pauses CLIENT UNPAUSE too: each pause runs its course.)
PAUSE_MS = 1500


def _register(redis_client, engine_id: str, base_model: str = "demo") -> None:
    snap = EngineSnapshot(id=engine_id, url=f"http://127.0.0.1:1/{engine_id}", base_model=base_model)
    redis_client.set(entry_key(engine_id), snap.encode(), ex=60)
    redis_client.sadd(REGISTRY_SET, engine_id)


async def _paused(redis) -> asyncio.Task:
    """Pause the server for every client and return a PING sent after the pause: it answers when the pause ends."""
    await redis.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
    ping = asyncio.create_task(redis.ping())
    await asyncio.sleep(0.05)  # the PING is on the wire, waiting
    assert not ping.done()
    return ping


def test_a_known_key_past_its_local_ttl_does_not_wait_for_a_stalled_redis(db, database_url, service_urls, redis_client):
    from services.gateway.auth import KeyAuth

    key = make_api_key(db, tenant=make_tenant(db))
    header = f"Bearer {key.secret}"

    async def main():
        auth = make_key_auth(database_url, service_urls.redis_url, pool_size=2)
        first = await auth.authenticate(header)  # fetched, and held in-process
        cache_key = next(iter(auth._local))
        expires, principal = auth._local[cache_key]
        auth._local[cache_key] = (expires - KeyAuth.LOCAL_TTL_S - 0.01, principal)  # just past its local TTL
        ping = await _paused(auth.redis)
        again = await auth.authenticate(header)
        assert not ping.done(), "the stale entry answered only after Redis did"
        assert again.key_id == first.key_id and auth._fetching  # and its renewal waits on Redis meanwhile
        await ping  # the pause has run its course
        renewal = next(iter(auth._fetching.values()), None)
        if renewal is not None:
            await renewal
        assert auth._local[cache_key][0] > expires - KeyAuth.LOCAL_TTL_S  # renewed

        # Too old to trust (past LOCAL_STALE_S as well): the request waits for the fetch, as on a cold cache.
        auth._local[cache_key] = (auth._local[cache_key][0] - KeyAuth.LOCAL_TTL_S - KeyAuth.LOCAL_STALE_S - 0.01, principal)
        ping = await _paused(auth.redis)
        waited = asyncio.create_task(auth.authenticate(header))
        await asyncio.sleep(0.2)
        assert not waited.done()
        await ping  # the pause has run its course
        assert (await waited).key_id == first.key_id
        await auth.redis.aclose()

    redis_client.flushdb()
    asyncio.run(main())


def test_a_revoked_key_stops_working_once_its_renewal_lands(db, database_url, service_urls, redis_client):
    """The stale answer is bounded: the renewal it starts reads the key's current state."""
    from services.gateway.auth import KeyAuth
    from services.common.errors import AuthenticationError

    key = make_api_key(db, tenant=make_tenant(db))
    header = f"Bearer {key.secret}"

    async def main():
        auth = make_key_auth(database_url, service_urls.redis_url, pool_size=2)
        await auth.authenticate(header)
        cache_key = next(iter(auth._local))
        await auth.redis.set(cache_key, b"-")  # what a revocation elsewhere leaves in the shared cache
        expires, principal = auth._local[cache_key]
        auth._local[cache_key] = (expires - KeyAuth.LOCAL_TTL_S - 0.01, principal)
        await auth.authenticate(header)  # stale: still served, and the renewal started
        await asyncio.gather(*auth._fetching.values())
        with pytest.raises(AuthenticationError):
            await auth.authenticate(header)
        await auth.redis.aclose()

    redis_client.flushdb()
    asyncio.run(main())


def test_the_engine_list_is_served_stale_while_one_refresh_waits_on_a_stalled_redis(service_urls, redis_client):
    from services.gateway.router import Registry
    from services.gateway.state import make_redis

    redis_client.flushdb()
    _register(redis_client, "e1")

    async def main():
        registry = Registry(make_redis(service_urls.redis_url), ttl_s=0.5, stale_s=30.0)
        assert [e.id for e in await registry.engines("demo")] == ["e1"]
        _register(redis_client, "e2")
        registry._at -= 1.0  # past its TTL, well inside stale_s
        ping = await _paused(registry.redis)
        listed = await asyncio.gather(*(registry.engines("demo") for _ in range(20)))
        assert not ping.done(), "the stale list answered only after Redis did"
        assert all([e.id for e in got] == ["e1"] for got in listed)
        refresh = registry._loading
        assert refresh is not None and not refresh.done()  # one refresh for all twenty callers
        await ping  # the pause has run its course
        await refresh
        assert [e.id for e in await registry.engines("demo")] == ["e1", "e2"]

        # A model the held list has no engine for: the caller waits for a fresh read (a new engine is
        # routable at once), and so does one whose list is older than stale_s.
        _register(redis_client, "e3", base_model="other")
        registry._at -= 1.0
        assert [e.id for e in await registry.engines("other")] == ["e3"]
        registry._at -= 31.0
        ping = await _paused(registry.redis)
        waited = asyncio.create_task(registry.engines("demo"))
        await asyncio.sleep(0.2)
        assert not waited.done()
        await ping  # the pause has run its course
        assert [e.id for e in await waited] == ["e1", "e2"]
        await registry.redis.aclose()

    asyncio.run(main())
