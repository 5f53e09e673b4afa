"""Chaos drill (issue 18, acceptance 3): engines die under load and the platform heals without a human.

Two engines and a gateway run under the real `services.devstack.Supervisor` (the code `make up` uses), so
a killed engine is restarted by it. The drill SIGKILLs one engine mid-load, then sends requests that crash
or fail an engine (failpoints), and checks what clients saw, what the ledger billed, and that nothing was
retried onto the surviving engine once an engine had taken it.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import func, select

from services.common.models import UsageEvent
from services.devstack import Proc, Supervisor, free_port, mplex_argv
from tests.factories import make_api_key, make_tenant
from tests.gateway.test_faults import _engine_metric, _isolated

CRASH, STEP_ERROR = 1501, 1502  # failpoint token ids; load prompts draw from LOAD_IDS, which holds neither
LOAD_IDS = range(200, 1400)
ENGINES = ("chaos-eng-0", "chaos-eng-1")
LONG = 200  # max_tokens of a long request (ignore_eos): a few seconds of decoding here


@dataclass
class Drill:
    """The supervised stack: `sup.procs` are the engines then the gateway; ticked by a background thread."""

    sup: Supervisor
    engines: dict[str, Proc]
    engine_urls: dict[str, str]
    gw_url: str
    redis: redis.Redis
    engine_headers: dict[str, str]
    events: list[tuple[float, str]] = field(default_factory=list)  # (monotonic, what the supervisor said)

    def log(self, engine_id: str) -> str:
        return (self.sup.log_dir / f"{engine_id}.log").read_text(errors="replace")

    def entry(self, engine_id: str) -> dict | None:
        raw = self.redis.get(f"mplex:engine:{engine_id}")
        return json.loads(raw) if raw else None

    def healthy(self, engine_id: str) -> bool:
        try:
            return httpx.get(f"{self.engine_urls[engine_id]}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_serving(self, engine_id: str, *, since_wall: float = 0.0, timeout: float = 90) -> float:
        """Until the engine answers /health and has a registry entry published by a process started after
        `since_wall` (epoch s). Returns when (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self.entry(engine_id)
            if e and e.get("started_at", 0) > since_wall and self.healthy(engine_id):
                return time.monotonic()
            time.sleep(0.1)
        raise AssertionError(f"{engine_id} did not come back; log tail:\n{self.log(engine_id)[-3000:]}")


@pytest.fixture(scope="module")
def drill(stack_env, demo_kit, tmp_path_factory):
    from services.common.internal_auth import client_headers
    from services.common.settings import Settings

    env = {**_isolated(stack_env, 9), "OMP_NUM_THREADS": "1",
           "MPLEX_BASE_MODEL_DIR": str(demo_kit.base_dir), "MPLEX_BASE_MODEL_NAME": demo_kit.model_name}
    events: list[tuple[float, str]] = []
    sup = Supervisor(tmp_path_factory.mktemp("chaos-logs"), say=lambda msg: events.append((time.monotonic(), msg)))
    stop = threading.Event()
    ticker = threading.Thread(target=_tick_until, args=(sup, stop), name="supervisor", daemon=True)
    try:
        urls = {}
        for engine_id in ENGINES:
            port = free_port()
            urls[engine_id] = f"http://127.0.0.1:{port}"
            sup.start(Proc(engine_id, mplex_argv(
                "engine", "serve", "--model", str(demo_kit.base_dir), "--served-model-name", demo_kit.model_name,
                "--port", str(port), "--engine-id", engine_id, "--kv-memory-mb", "64", "--max-loras", "8",
                "--failpoint", f"crash={CRASH}", "--failpoint", f"step_error={STEP_ERROR}"),
                ready_url=f"{urls[engine_id]}/health", env=env), timeout=180)  # its one open endpoint
        gw_port = free_port()
        sup.start(Proc("chaos-gw", mplex_argv("gateway", "serve", "--port", str(gw_port)),
                       ready_url=f"http://127.0.0.1:{gw_port}/ready", env=env), timeout=180)
        ticker.start()
        d = Drill(sup, {p.name: p for p in sup.procs if p.name in ENGINES}, urls, f"http://127.0.0.1:{gw_port}",
                  redis.Redis.from_url(env["MPLEX_REDIS_URL"]),
                  client_headers(Settings(home=Path(env["MPLEX_HOME"]), engine_tokens=env.get("MPLEX_ENGINE_TOKENS"))),
                  events)
        for engine_id in ENGINES:
            d.wait_serving(engine_id, timeout=30)
        yield d
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join(timeout=5)
        sup.stop()


def _tick_until(sup: Supervisor, stop: threading.Event) -> None:
    while not stop.is_set():
        sup.tick()
        stop.wait(0.2)


# -- one request and what its client saw -------------------------------------------------------------------

@dataclass
class Outcome:
    cid: str  # x-client-request-id: the ledger row's client_request_id
    stream: bool
    max_tokens: int
    started: float
    ended: float = 0.0
    status: int = 0
    ok: bool = False  # a 200 with the whole completion
    error: dict | None = None  # the OpenAI error object (5xx body or SSE error event)
    received: int = 0  # completion tokens the client received
    unclean: str | None = None  # why the ending was not clean: hung, cut off, malformed


def _body(model: str, rng: random.Random, max_tokens: int, stream: bool, prompt: list[int] | None = None) -> dict:
    prompt = prompt or [rng.choice(LOAD_IDS) for _ in range(rng.randint(8, 40))]
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "logprobs": 0, "temperature": 0.8, "seed": rng.randint(0, 2**31)}


async def _send(c: httpx.AsyncClient, key: str, body: dict) -> Outcome:
    out = Outcome(f"chaos-{uuid.uuid4().hex[:16]}", body["stream"], body["max_tokens"], time.monotonic())
    headers = {"authorization": f"Bearer {key}", "x-client-request-id": out.cid}
    try:
        async with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = _error_object(json.loads(await r.aread()))
            elif body["stream"]:
                await _read_sse(r, out)
            else:
                doc = json.loads(await r.aread())
                out.received = doc["usage"]["completion_tokens"]
                out.ok = doc["choices"][0]["finish_reason"] == "length" and out.received == out.max_tokens
                if not out.ok:
                    out.unclean = f"a 200 with an incomplete completion: {doc}"
    except (httpx.HTTPError, ValueError, KeyError) as exc:  # hung (timeout), cut off, or not OpenAI-shaped
        out.unclean = f"{exc.__class__.__name__}: {exc}"
    out.ended = time.monotonic()
    if out.status not in (0, 200) and out.error is None and out.unclean is None:
        out.unclean = f"{out.status} without an OpenAI error body"
    return out


async def _read_sse(r: httpx.Response, out: Outcome) -> None:
    done = False
    finish = None
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if out.error is not None or done:
            out.unclean = f"data after the stream ended: {line[:200]}"
            return
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out.error = _error_object(chunk)
            continue
        choice = chunk["choices"][0]
        if choice.get("logprobs"):
            out.received += len(choice["logprobs"]["tokens"])
        finish = choice.get("finish_reason") or finish
    if done and finish == "length" and out.received == out.max_tokens:
        out.ok = True
    elif out.error is None:
        out.unclean = f"stream ended without [DONE] or an error event (finish={finish}, tokens={out.received})"


def _error_object(doc: dict) -> dict:
    err = doc["error"]
    assert {"message", "type", "code"} <= set(err), err  # OpenAI shape
    return err


def _rows(db, cids: list[str], timeout: float = 30) -> dict[str, list[UsageEvent]]:
    """Ledger rows by client request id, once every one of `cids` has landed."""
    deadline = time.time() + timeout
    while True:
        db.expire_all()
        rows = db.execute(select(UsageEvent).where(UsageEvent.client_request_id.in_(cids))).scalars().all()
        by_cid: dict[str, list[UsageEvent]] = {}
        for row in rows:
            by_cid.setdefault(row.client_request_id, []).append(row)
        if len(by_cid) == len(set(cids)) or time.time() > deadline:
            return by_cid
        time.sleep(0.2)


def _running(d: Drill, engine_id: str) -> float:
    try:
        return _engine_metric(d.engine_urls[engine_id], "mplex_engine_requests_running", d.engine_headers)
    except httpx.HTTPError:
        return 0.0


def _prompt_tokens(d: Drill, engine_id: str) -> float:
    return _engine_metric(d.engine_urls[engine_id], "mplex_engine_prompt_tokens_total", d.engine_headers)


# -- 1. SIGKILL one engine under load ------------------------------------------------------------------------

def test_sigkill_an_engine_under_load(drill, demo_kit, db):
    d = drill
    victim, survivor = ENGINES
    tenant = make_tenant(db, limits={"tokens_per_min": 10_000_000, "requests_per_min": 100_000,
                                     "concurrent_requests": 200})
    key = make_api_key(db, tenant=tenant).secret
    rng = random.Random(18)
    clients = 8
    kill: dict[str, float] = {}

    async def client(c: httpx.AsyncClient, stop: asyncio.Event, results: list[Outcome]) -> None:
        while not stop.is_set():
            long = rng.random() < 0.5
            body = _body(demo_kit.model_name, rng, LONG if long else rng.randint(8, 32), rng.random() < 0.6)
            results.append(await _send(c, key, body))

    async def load() -> tuple[list[Outcome], Outcome]:
        results: list[Outcome] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=d.gw_url, timeout=60) as c:
            tasks = [asyncio.create_task(client(c, stop, results)) for _ in range(clients)]
            # Kill while the victim holds several sequences (long ones among them, by the mix).
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(_running, d, victim) < 4:
                assert time.monotonic() < deadline, "the victim never got load"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)
            proc = d.engines[victim]
            pid = proc.popen.pid
            kill["wall"] = time.time()
            kill["sent"] = time.monotonic()  # a client may see the drop before the loop below notices the death
            os.killpg(pid, signal.SIGKILL)
            while proc.popen.pid == pid and proc.popen.poll() is None:  # dead (its sockets closed), not just signalled
                await asyncio.sleep(0.01)
            kill["t"] = time.monotonic()
            kill["back"] = await asyncio.to_thread(d.wait_serving, victim, since_wall=kill["wall"])
            # Keep the load on a little longer: the restarted engine takes traffic again alongside the other.
            n = len(results)
            while len(results) < n + 2 * clients:
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.gather(*tasks)
            # (c) The restarted engine serves again: fresh prompts until one lands on it (its breaker, opened
            # by the kill, lets a probe through once its cooldown is over).
            served_again = None
            deadline = time.monotonic() + 60
            while served_again is None:
                assert time.monotonic() < deadline, "the restarted engine was never routed to again"
                o = await _send(c, key, _body(demo_kit.model_name, rng, 4, False))
                results.append(o)
                assert o.ok, o
                if (await asyncio.to_thread(_rows, db, [o.cid]))[o.cid][0].engine_id == victim:
                    served_again = o
                else:
                    await asyncio.sleep(0.3)
        return results, served_again

    t0 = time.monotonic()
    results, served_again = asyncio.run(load())
    t_kill, t_back = kill["t"], kill["back"]
    respawned = next(t for t, msg in d.events if msg.startswith(f">> restarting {victim}") and t > t_kill)

    # (a) Every request ended cleanly: a whole completion, or an OpenAI error (5xx body or SSE error event).
    unclean = [o for o in results if o.unclean]
    assert not unclean, unclean[:5]
    failed = [o for o in results if not o.ok]
    assert failed, "no request was in flight on the killed engine"
    for o in failed:
        # Only requests the victim could hold: started before its death was seen (between SIGKILL and the process
        # gone its listening socket still takes connections), and not over before the kill.
        assert o.started < kill["t"] and kill["sent"] < o.ended, o
        assert o.error["code"] == "engine_failed", o
        assert (o.status == 200 and o.stream) or o.status == 502, o  # SSE error event mid-stream, else a 502
        assert o.received < o.max_tokens and (o.stream or o.received == 0)
    # (b) Requests started after the kill all succeeded; those over before the victim was even respawned
    # were served by the survivor.
    after = [o for o in results if o.started > t_kill]
    assert after and all(o.ok for o in after)

    # (c) The supervisor restarted the victim (same code as `make up`) and it rejoined the registry.
    assert d.engines[victim].restarts >= 1 and d.engines[victim].popen.poll() is None
    assert d.entry(victim)["started_at"] > kill["wall"]

    # (d) One ledger row per request sent: none lost, none doubled; billed = what the client received.
    rows = _rows(db, [o.cid for o in results])
    assert len(results) == len({o.cid for o in results})
    assert sorted(rows) == sorted(o.cid for o in results), "requests missing from the ledger"
    assert all(len(r) == 1 for r in rows.values()), "a request was metered twice"
    tenant_rows = select(func.count()).select_from(UsageEvent).where(UsageEvent.tenant_id == tenant.id)
    assert db.execute(tenant_rows).scalar_one() == len(results)
    exact = 0
    for o in results:
        row = rows[o.cid][0]
        if o.ok:
            assert (row.status, row.completion_tokens) == ("ok", o.received), row
        else:
            assert (row.status, row.error_code) == ("error", "engine_failed"), row
            assert row.engine_id in (victim, None), row  # None: lost before its first token
            assert row.completion_tokens <= o.received, (o, row.completion_tokens)
            exact += row.completion_tokens == o.received
    before_respawn = [o for o in after if o.ended < respawned]
    assert all(rows[o.cid][0].engine_id == survivor for o in before_respawn)
    assert rows[served_again.cid][0].engine_id == victim
    # Failed requests gave their quota reservations and concurrency seats back like the others.
    deadline = time.time() + 15
    while d.redis.keys("q:res:*") and time.time() < deadline:
        time.sleep(0.2)
    assert d.redis.keys("q:res:*") == [] and d.redis.zcard(f"q:tenant:{tenant.id}:conc") == 0

    in_flight_streams = [o for o in failed if o.stream and o.status == 200]
    print(f"\nchaos drill: {len(results)} requests ({sum(o.stream for o in results)} streamed) by {clients} clients "
          f"in {time.monotonic() - t0:.1f}s; {len(failed)} in flight on the killed engine failed cleanly "
          f"({len(in_flight_streams)} mid-stream SSE error events, {len(failed) - len(in_flight_streams)} 502s), "
          f"{len(after)} started after the kill all served ({len(before_respawn)} by the survivor before the "
          f"respawn); billed == received for {exact}/{len(failed)} failed; "
          f"restart: respawned {respawned - t_kill:.1f}s after the kill, serving and registered after "
          f"{t_back - t_kill:.1f}s", flush=True)


# -- 2. A request that crashes its engine is not retried elsewhere ----------------------------------------------

def test_a_request_that_kills_its_engine_is_not_retried_on_another(drill, demo_kit, db):
    d = drill
    tenant = make_tenant(db)
    key = make_api_key(db, tenant=tenant).secret
    rng = random.Random(7)
    for engine_id in ENGINES:
        d.wait_serving(engine_id)
    pids = {e: d.engines[e].popen.pid for e in ENGINES}
    restarts = {e: d.engines[e].restarts for e in ENGINES}
    prompt_tokens = {e: _prompt_tokens(d, e) for e in ENGINES}

    async def one(body: dict) -> Outcome:
        async with httpx.AsyncClient(base_url=d.gw_url, timeout=60) as c:
            return await _send(c, key, body)

    poison = [rng.choice(LOAD_IDS) for _ in range(6)] + [CRASH] + [rng.choice(LOAD_IDS) for _ in range(6)]
    t_crash = time.time()
    o = asyncio.run(one(_body(demo_kit.model_name, rng, 16, False, poison)))
    assert o.status == 502 and o.error["code"] == "engine_failed" and not o.unclean, o
    row = _rows(db, [o.cid])[o.cid]
    assert len(row) == 1
    assert (row[0].status, row[0].error_code, row[0].completion_tokens) == ("error", "engine_failed", 0)
    rid = row[0].request_id

    # Exactly one engine took it (and died of it); the other never saw it and is the same process.
    took = [e for e in ENGINES if re.search(rf"\b{re.escape(rid)}\b", d.log(e))]
    assert len(took) == 1, took
    crashed, other = took[0], next(e for e in ENGINES if e != took[0])
    assert f"failpoint crash hit by request {rid}" in d.log(crashed)
    # The ledger names the engine it was lost in, and a request that failed on our side before delivering
    # anything costs the tenant nothing.
    assert row[0].engine_id == crashed and row[0].prompt_tokens == 0
    assert d.engines[other].popen.pid == pids[other] and d.engines[other].popen.poll() is None
    assert d.engines[other].restarts == restarts[other]
    assert _prompt_tokens(d, other) == prompt_tokens[other]
    t0 = time.monotonic()
    d.wait_serving(crashed, since_wall=t_crash)  # restarted by the supervisor, registered again
    assert d.engines[crashed].restarts == restarts[crashed] + 1 and d.engines[crashed].popen.pid != pids[crashed]
    back_s = time.monotonic() - t0

    # A request the engine fails on its own account (its forward raises): 500 request_failed, sent to one engine
    # only, and both engines live on.
    pids = {e: d.engines[e].popen.pid for e in ENGINES}
    for stream in (False, True):
        bad = [rng.choice(LOAD_IDS) for _ in range(5)] + [STEP_ERROR] + [rng.choice(LOAD_IDS) for _ in range(5)]
        o = asyncio.run(one(_body(demo_kit.model_name, rng, 16, stream, bad)))
        assert o.status == 500 and o.error["code"] == "request_failed" and not o.unclean, o
        row = _rows(db, [o.cid])[o.cid]
        assert len(row) == 1 and (row[0].status, row[0].http_status, row[0].completion_tokens) == ("error", 500, 0)
        assert row[0].prompt_tokens == 0  # failed on our side before any token: not billed
        rid = row[0].request_id
        took = [e for e in ENGINES if re.search(rf"\b{re.escape(rid)}\b", d.log(e))]
        assert len(took) == 1, took
        assert f"failpoint step_error hit by request {rid}" in d.log(took[0])
    for e in ENGINES:
        assert d.engines[e].popen.pid == pids[e] and d.engines[e].popen.poll() is None and d.healthy(e)
    ok = asyncio.run(one(_body(demo_kit.model_name, rng, 8, True)))
    assert ok.ok, ok
    print(f"\nno cascade: the poison request killed {crashed} only ({other} never saw it); {crashed} was "
          f"serving again {back_s:.1f}s after the 502; step_error requests failed alone (500), both engines lived",
          flush=True)
