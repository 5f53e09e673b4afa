"""The gateway under stress and faults: quota exactness at 200 concurrent requests, a disconnect
storm, Postgres stopping mid-traffic, and an engine dying before the first token."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest
import redis
from sqlalchemy import func, select

from services.common.models import UsageEvent
from tests.factories import make_api_key, make_tenant
from tests.stack import Stack


def _isolated(env: dict[str, str], db_index: int) -> dict[str, str]:
    """The same Redis server but another database: a separate engine registry for a private stack."""
    base = env["MPLEX_REDIS_URL"].rsplit("/", 1)[0]
    redis.Redis.from_url(f"{base}/{db_index}").flushdb()
    return {**env, "MPLEX_REDIS_URL": f"{base}/{db_index}"}


def _ledger(db, tenant_id, expect: int, timeout: float = 30) -> list[UsageEvent]:
    deadline = time.time() + timeout
    rows: list[UsageEvent] = []
    while time.time() < deadline:
        db.expire_all()
        rows = list(db.execute(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)).scalars())
        if len(rows) >= expect:
            return rows
        time.sleep(0.2)
    raise AssertionError(f"ledger has {len(rows)} rows for the tenant, expected {expect}")


def _engine_metric(url: str, name: str, headers: dict[str, str]) -> float:
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def _wait_engines_idle(stack) -> None:
    deadline, auth = time.time() + 30, stack.engine_headers()
    while time.time() < deadline:
        if all(_engine_metric(e.url, "mplex_engine_requests_running", auth) == 0
               and _engine_metric(e.url, "mplex_engine_requests_waiting", auth) == 0
               and _engine_metric(e.url, "mplex_engine_kv_blocks_used", auth) == 0 for e in stack.engines):
            return
        time.sleep(0.2)
    raise AssertionError("engines kept running sequences or KV blocks")


def _assert_quota_state_clean(stack, tenant_id) -> None:
    r = redis.Redis.from_url(stack.env["MPLEX_REDIS_URL"])
    deadline = time.time() + 15  # cancelled streams settle as the gateway notices each hang-up
    while r.keys("q:res:*") and time.time() < deadline:
        time.sleep(0.2)
    assert r.keys("q:res:*") == [], "reservations left unsettled"
    assert r.zcard(f"q:tenant:{tenant_id}:conc") == 0
    for key in r.keys("q:*"):
        assert r.ttl(key) > 0, f"{key!r} has no TTL"


def test_quota_exactness_under_200_concurrent_requests(stack, demo_kit, db):
    limit = 2400
    tenant = make_tenant(db, limits={"tokens_per_min": limit})
    key = make_api_key(db, tenant=tenant).secret
    body = {"model": demo_kit.model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}

    async def main():
        async with httpx.AsyncClient(base_url=stack.gw.url, timeout=120, limits=httpx.Limits(max_connections=200)) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}) for _ in range(200)))

    responses = asyncio.run(main())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 200 and ok and refused
    worst_case = ok[0].json()["usage"]["prompt_tokens"] + body["max_tokens"]
    assert len(ok) * worst_case <= limit  # admitted reservations never exceeded the window
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
    _assert_quota_state_clean(stack, tenant.id)
    rows = _ledger(db, tenant.id, len(ok))
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert sum(row.prompt_tokens + row.completion_tokens for row in rows) == used
    r = redis.Redis.from_url(stack.env["MPLEX_REDIS_URL"])
    window = [int(r.get(k)) for k in r.keys(f"q:tenant:{tenant.id}:tpm:*")]
    assert sum(window) == used  # reservations were replaced by actual usage, exactly


def test_a_client_leaving_right_after_done_is_still_settled_and_metered(stack, demo_kit, db):
    """The SDK stops reading at `data: [DONE]` and closes the response before the chunked body's end, which the
    gateway sends only after settling the quota and writing the ledger row: that hang-up must not cancel them."""
    import openai

    tenant = make_tenant(db)
    client = openai.OpenAI(base_url=f"{stack.gw.url}/v1", api_key=make_api_key(db, tenant=tenant).secret,
                           max_retries=0, timeout=60)
    n = 12
    for i in range(n):
        chunks = list(client.completions.create(model=demo_kit.model_name, prompt=f"hello {i}", max_tokens=4,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    rows = _ledger(db, tenant.id, n)
    assert len(rows) == n and all(r.status == "ok" for r in rows)
    _assert_quota_state_clean(stack, tenant.id)


@pytest.mark.parametrize("logprobs", [0, None], ids=["logprobs", "fast-path"])
def test_disconnect_storm_frees_engines_settles_quotas_and_meters_delivered_tokens(stack, demo_kit, db, logprobs):
    """With logprobs each chunk says how many tokens it carries; without, the gateway's fast path (chunks written
    from the engine socket's dispatch, services.common.streaming.DirectBody) relays them and a chunk is at least
    one token."""
    tenant = make_tenant(db, limits={"concurrent_requests": 200})
    key = make_api_key(db, tenant=tenant).secret
    rng = random.Random(5)
    cancel = set(rng.sample(range(100), 30))
    max_tokens = 48
    # A stream the client will hang up on asks for far more tokens than it reads: with 48, the gateway
    # could write the whole stream into socket buffers before a busy client reads its first chunk,
    # and then "ok" would be the right status.
    cancelled_max_tokens = 400

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, int, bool]:
        body = {"model": demo_kit.model_name, "prompt": f"Hello {i}", "stream": True, "ignore_eos": True,
                "max_tokens": cancelled_max_tokens if i in cancel else max_tokens}
        if logprobs is not None:
            body["logprobs"] = logprobs
        received = 0
        async with c.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            stop_after = rng.randint(1, 6)
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                    received += len(chunk["choices"][0]["logprobs"]["tokens"])
                elif chunk["choices"] and logprobs is None:
                    received += 1  # a chunk: at least one token
                if i in cancel and received >= stop_after:
                    break  # leaving the block closes the connection mid-stream
        return rid, received, i in cancel

    async def main():
        async with httpx.AsyncClient(base_url=stack.gw.url, timeout=300, limits=httpx.Limits(max_connections=120)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(100)))

    results = asyncio.run(main())
    _wait_engines_idle(stack)
    _assert_quota_state_clean(stack, tenant.id)
    rows = {row.request_id: row for row in _ledger(db, tenant.id, 100)}
    assert len(rows) == 100
    for rid, received, cancelled in results:
        row = rows[rid]
        if cancelled:
            assert row.status == "cancelled"
            # Billed = what the gateway wrote to the client; a few chunks may still sit in socket buffers.
            assert received <= row.completion_tokens < cancelled_max_tokens
        elif logprobs is not None:
            assert row.status == "ok" and row.completion_tokens == received == max_tokens
        else:
            assert row.status == "ok" and row.completion_tokens == max_tokens and 0 < received <= max_tokens


def test_ledger_survives_postgres_stopping_mid_traffic(stack_env, demo_kit, db, tmp_path, tmp_path_factory):
    from services.common.embedded import EmbeddedPostgres
    from services.common.migrate import upgrade
    from tests.factories import make_api_key as mk_key, make_tenant as mk_tenant
    from services.common.db import make_db_engine
    from sqlalchemy.orm import Session

    pg = EmbeddedPostgres(tmp_path / "pg")
    url = pg.start()
    upgrade(url)
    engine = make_db_engine(url)
    with Session(engine, expire_on_commit=False) as s:
        tenant = mk_tenant(s)
        key = mk_key(s, tenant=tenant).secret
    env = {**_isolated(stack_env, 4), "MPLEX_DATABASE_URL": url}
    s2 = Stack(env, tmp_path_factory.mktemp("pgfault"))
    try:
        s2.engines = [s2.engine(demo_kit.base_dir, demo_kit.model_name, "pgfault-eng", wait=False)]
        s2.gw = s2.gateway(demo_kit.base_dir, demo_kit.model_name, name="pgfault-gw", wait=False)
        s2.wait_ready(*s2.engines, s2.gw)
        body = {"model": demo_kit.model_name, "prompt": "Hello", "max_tokens": 24, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(base_url=s2.gw.url, timeout=300) as c:
                h = {"authorization": f"Bearer {key}"}
                await c.post("/v1/completions", json={**body, "max_tokens": 1}, headers=h)  # warm the key cache
                tasks = [asyncio.create_task(c.post("/v1/completions", json=body, headers=h)) for _ in range(50)]
                await asyncio.sleep(0.3)
                await asyncio.to_thread(pg.stop)  # Postgres goes away while the 50 are in flight
                responses = await asyncio.gather(*tasks)
                await asyncio.to_thread(pg.start)
                return responses

        responses = asyncio.run(main())
        assert all(r.status_code == 200 for r in responses)
        expected = {r.headers["x-request-id"]: r.json()["usage"] for r in responses}
        deadline = time.time() + 60
        rows = []
        while time.time() < deadline:
            with Session(make_db_engine(url)) as s:
                rows = list(s.execute(select(UsageEvent).where(UsageEvent.request_id.in_(list(expected)))).scalars())
            if len(rows) == 50:
                break
            time.sleep(0.5)
        assert len(rows) == 50
        for row in rows:
            u = expected[row.request_id]
            assert (row.prompt_tokens, row.completion_tokens) == (u["prompt_tokens"], u["completion_tokens"])
        with Session(make_db_engine(url)) as s:
            n = s.execute(select(func.count()).select_from(UsageEvent).where(UsageEvent.tenant_id == tenant.id)).scalar_one()
        assert n == 51  # the 50 plus the warm-up, nothing doubled by the replay
    finally:
        s2.close()
        pg.stop()


def test_engine_dying_before_first_token_is_retried_elsewhere(stack_env, demo_kit, db, tmp_path_factory):
    tenant = make_tenant(db)
    key = make_api_key(db, tenant=tenant).secret
    s3 = Stack(_isolated(stack_env, 3), tmp_path_factory.mktemp("failover"))
    try:
        engines = [s3.engine(demo_kit.base_dir, demo_kit.model_name, f"fo-eng-{i}", wait=False) for i in range(2)]
        s3.gw = s3.gateway(demo_kit.base_dir, demo_kit.model_name, name="fo-gw", wait=False)
        s3.wait_ready(*engines, s3.gw)
        s3.stop(engines[0], sig=signal.SIGKILL)  # its registry entry lives on for a few seconds
        with httpx.Client(base_url=s3.gw.url, timeout=60) as c:
            for i in range(8):
                r = c.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                           json={"model": demo_kit.model_name, "prompt": f"Hi {i} " * (i + 1), "max_tokens": 3})
                assert r.status_code == 200, r.text
        rows = _ledger(db, tenant.id, 8)
        assert {row.engine_id for row in rows} == {"fo-eng-1"}
    finally:
        s3.close()


def test_an_engine_refusing_the_gateways_credential_is_a_503_never_the_engines_401(stack_env, demo_kit, db,
                                                                                     tmp_path_factory):
    """Mismatched MPLEX_ENGINE_TOKENS (a botched rotation) is the platform's fault: the tenant never sees the
    engine's 401, and the engine served nothing."""
    tenant = make_tenant(db)
    key = make_api_key(db, tenant=tenant).secret
    s5 = Stack({**_isolated(stack_env, 5), "MPLEX_ENGINE_TOKENS": "engine-token-of-the-engines-0123456789abc"},
               tmp_path_factory.mktemp("wrong-token"))
    try:
        engine = s5.engine(demo_kit.base_dir, demo_kit.model_name, "wrongtok-eng", wait=False)
        s5.gw = s5.gateway(demo_kit.base_dir, demo_kit.model_name, name="wrongtok-gw", wait=False,
                           env={"MPLEX_ENGINE_TOKENS": "engine-token-of-the-gateway-0123456789abc"})
        s5.wait_ready(engine, s5.gw)
        r = httpx.post(f"{s5.gw.url}/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": demo_kit.model_name, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_engine_available"
        assert _engine_metric(engine.url, "mplex_engine_prompt_tokens_total", s5.engine_headers()) == 0
    finally:
        s5.close()
