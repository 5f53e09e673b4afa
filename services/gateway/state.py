"""Everything a gateway process holds: clients, caches and the request-path components, built once."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from importlib import metadata
from pathlib import Path

import aiohttp
import hiredis
import redis.asyncio as aioredis
from redis.driver_info import DriverInfo
from sqlalchemy.orm import Session, sessionmaker

from services.common.internal_auth import client_headers
from services.common.settings import Settings
from services.gateway.auth import KeyAuth
from services.gateway.engine_streams import StreamsPool
from services.gateway.metering import Meter
from services.gateway.metrics import GatewayMetrics
from services.gateway.quotas import Quotas
from services.gateway.resolve import BaseModelInfo, ModelResolver
from services.gateway.router import Registry, Router

log = logging.getLogger("mplex.gateway")


@dataclasses.dataclass
class Gateway:
    settings: Settings
    session_factory: sessionmaker[Session]
    redis: aioredis.Redis
    key_auth: KeyAuth
    quotas: Quotas
    registry: Registry
    router: Router
    resolver: ModelResolver
    meter: Meter
    http: aiohttp.ClientSession
    metrics: GatewayMetrics
    pricer: object | None = None  # services.billing pricing, for the billed-amount metric
    streams: StreamsPool | None = None  # the engines' streams sockets; None: one HTTP stream per request

    async def aclose(self) -> None:
        await self.meter.stop()
        if self.streams is not None:
            await self.streams.aclose()
        await self.http.close()
        await self.redis.aclose()


# Given once: without it redis-py reads its own package metadata (importlib.metadata, ~0.5 ms) for every new
# connection, on the event loop -- a burst of 256 requests on a cold pool took 366 ms of pings instead of 143.
_DRIVER_INFO = DriverInfo(name="redis-py", lib_version=metadata.version("redis"))


def make_redis(url: str, max_connections: int = 256) -> aioredis.Redis:
    """A client whose pool waits for a free connection under bursts instead of failing. Short socket
    timeouts: a Redis outage must become a fast 503, not a hung request."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=5, socket_timeout=2, socket_connect_timeout=2,
        health_check_interval=10, driver_info=_DRIVER_INFO,
    )
    pool.connection_class = _hiredis_packing(pool.connection_class)  # the URL's scheme chose TCP, TLS or a socket
    return aioredis.Redis(connection_pool=pool)


def _hiredis_packing(connection_class: type) -> type:
    """`connection_class` packing its commands in C (hiredis, which already parses the replies). redis-py's asyncio
    connection packs each argument in Python: for a quota reservation's EVALSHA (two dozen arguments) that was 4% of
    the gateway loop's time while it admitted a burst of requests."""

    class HiredisPacking(connection_class):
        def pack_command(self, *args) -> list[bytes]:
            head = args[0]  # a command given as one string ("CLIENT SETINFO") is sent as its words, as redis-py does
            if isinstance(head, str):
                args = (*head.encode().split(), *args[1:])
            elif b" " in head:
                args = (*head.split(), *args[1:])
            for arg in args:
                if arg is None or isinstance(arg, bool):  # what redis-py's encoder refuses, refused the same way
                    self.encoder.encode(arg)
            return [hiredis.pack_command(args)]

    HiredisPacking.__name__ = HiredisPacking.__qualname__ = f"HiredisPacking{connection_class.__name__}"
    return HiredisPacking


WARM_REDIS_CONNECTIONS = 64


async def warm_redis_pool(redis: aioredis.Redis, n: int = WARM_REDIS_CONNECTIONS) -> None:
    """Open `n` pooled connections before the first request. A burst on a cold pool opens one connection per
    concurrent command (connect, CLIENT SETINFO twice, SELECT) on the event loop: tenant A's 300 requests at once
    on a freshly started gateway held every request's key check and quota reservation for 1.5-4.5 s on the
    loaded 2-core VM (tenant B's first requests included) while 256 connections were opened. Best effort: a
    Redis that is down now is reported by /ready and the request path, not here."""
    try:
        await asyncio.wait_for(asyncio.gather(*(redis.ping() for _ in range(n))), timeout=5)
    except Exception as exc:  # the gateway must start without Redis (quota fail-open/closed decides later)
        log.warning("could not warm the Redis pool: %s", exc)


def build_gateway(settings: Settings, *, database_url: str, redis_url: str, base_model_dir: Path) -> Gateway:
    from services.common.db import make_db_engine, make_sessionmaker

    db_engine = make_db_engine(database_url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow)
    session_factory = make_sessionmaker(db_engine)
    redis = make_redis(redis_url)
    metrics = GatewayMetrics()

    async def month_usage(kind: str, scope_id: str) -> int:
        import asyncio

        from services.gateway.usage_queries import tokens_this_month

        return await asyncio.to_thread(tokens_this_month, session_factory, kind, scope_id)

    http = aiohttp.ClientSession(
        headers=client_headers(settings),  # every engine endpoint requires the platform credential
        timeout=aiohttp.ClientTimeout(total=None, connect=2.0, sock_read=600.0),
        connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0, keepalive_timeout=30),
    )
    return Gateway(
        settings=settings,
        session_factory=session_factory,
        redis=redis,
        key_auth=KeyAuth(redis, session_factory, settings.secret(), settings.key_cache_ttl_s),
        quotas=Quotas(redis, fail_open=settings.redis_fail_open, month_usage=month_usage),
        registry=Registry(redis),
        router=Router(refusal_hold_s=settings.refusal_hold_s),
        resolver=ModelResolver(session_factory, [BaseModelInfo.from_dir(settings.base_model_name, base_model_dir)]),
        meter=Meter(session_factory, settings.home / "spool", metrics),
        http=http,
        metrics=metrics,
        streams=StreamsPool(http, settings.engine_stream_sockets) if settings.engine_stream_sockets else None,
    )
