"""Routing policy: adapter residency, prefix affinity, bounded load, retry order."""
from services.gateway.router import EngineInfo, Router


def eng(i: int, running=0, adapters=()) -> EngineInfo:
    return EngineInfo(f"e{i}", f"http://e{i}", "base", frozenset(adapters), frozenset(), running, 0, 0.0, 256, 512)


def test_same_affinity_key_goes_to_the_same_engine():
    r = Router()
    engines = [eng(i) for i in range(4)]
    first = {r.order(engines, b"tenant-a:prefix")[0].id for _ in range(5)}
    assert len(first) == 1


def test_keys_spread_over_engines():
    r = Router()
    engines = [eng(i) for i in range(4)]
    chosen = {r.order(engines, f"k{i}".encode())[0].id for i in range(200)}
    assert chosen == {"e0", "e1", "e2", "e3"}


def test_engine_holding_the_adapter_is_preferred():
    r = Router()
    engines = [eng(0), eng(1), eng(2, adapters=["sha-x"])]
    assert r.order(engines, b"sha-x", adapter="sha-x")[0].id == "e2"


def test_overloaded_engine_is_skipped_even_if_it_holds_the_adapter():
    r = Router()
    engines = [eng(0, running=1), eng(1, running=1), eng(2, running=40, adapters=["sha-x"])]
    order = r.order(engines, b"sha-x", adapter="sha-x")
    assert order[0].id != "e2" and order[-1].id == "e2"


def test_order_lists_every_engine_once_for_retries():
    r = Router()
    engines = [eng(i, running=i) for i in range(5)]
    order = r.order(engines, b"x")
    assert sorted(e.id for e in order) == [f"e{i}" for i in range(5)]


def test_inflight_counts_toward_load_until_closed():
    r = Router()
    engines = [eng(0), eng(1)]
    key = b"k"
    home = r.order(engines, key)[0].id
    for _ in range(10):
        r.opened(home)
    assert r.order(engines, key)[0].id != home
    for _ in range(10):
        r.closed(home)
    assert r.order(engines, key)[0].id == home and r.inflight == {}


def test_an_overload_refusal_is_held_per_engine_tenant_and_class_for_a_moment():
    now = [100.0]
    r = Router(clock=lambda: now[0], refusal_hold_s=0.25)
    r.refused("e0", "tenant-a", "interactive", retry_after=3)
    assert r.holding("e0", "tenant-a", "interactive") == 3
    # Another engine, tenant or class was not refused: asked as usual.
    assert r.holding("e1", "tenant-a", "interactive") is None
    assert r.holding("e0", "tenant-b", "interactive") is None
    assert r.holding("e0", "tenant-a", "batch") is None
    now[0] += 0.26  # held for the shorter of the hold and Retry-After, then asked again -- by one request first
    assert r.holding("e0", "tenant-a", "interactive") is None  # the probe
    assert r.holding("e0", "tenant-a", "interactive") == 3  # the others wait a moment for its answer
    r.refused("e0", "tenant-a", "interactive", retry_after=2)  # still overloaded: held again
    assert r.holding("e0", "tenant-a", "interactive") == 2
    now[0] += 0.26
    assert r.holding("e0", "tenant-a", "interactive") is None  # the next probe, which the engine takes:
    now[0] += 0.049
    assert r.holding("e0", "tenant-a", "interactive") == 2
    now[0] += 0.002  # no refusal within the probe's moment: everyone asks again
    assert r.holding("e0", "tenant-a", "interactive") is None and not r.refusals
    assert r.holding("e0", "tenant-a", "interactive") is None


def test_a_request_is_held_everywhere_only_while_every_engine_holds_its_tenants_class():
    now = [100.0]
    r = Router(clock=lambda: now[0], refusal_hold_s=0.25)
    assert r.held_everywhere([], "tenant-a", "interactive") is None  # no engine: not an overload refusal
    r.refused("e0", "tenant-a", "interactive", retry_after=3)
    assert r.held_everywhere(["e0", "e1"], "tenant-a", "interactive") is None  # e1 would still be asked
    r.refused("e1", "tenant-a", "interactive", retry_after=2)
    assert r.held_everywhere(["e0", "e1"], "tenant-a", "interactive") == 2  # the soonest Retry-After
    assert r.held_everywhere(["e0", "e1"], "tenant-b", "interactive") is None
    assert r.held_everywhere(["e0", "e1"], "tenant-a", "batch") is None
    assert r.held_everywhere(["e0", "e1", "e2"], "tenant-a", "interactive") is None  # a new engine joined
    now[0] += 0.26  # the holds ended: the request walks the engines (and probes them), nothing refuses it here
    assert r.held_everywhere(["e0", "e1"], "tenant-a", "interactive") is None
    assert r.holding("e0", "tenant-a", "interactive") is None  # it probes e0: held_everywhere claimed nothing
    assert r.held_everywhere(["e0", "e1"], "tenant-a", "interactive") is None  # e1 is free to ask
    assert r.holding("e1", "tenant-a", "interactive") is None
    assert r.held_everywhere(["e0", "e1"], "tenant-a", "interactive") == 2  # both probes out: held a moment


def test_when_every_engine_holds_a_refusal_the_gateway_refuses_without_asking():
    import asyncio

    import pytest

    from services.common.engine_wire import GenerateRequest
    from services.gateway.upstream import NoEngineAvailable, StreamResult, open_choice

    r = Router()
    engines = [eng(0), eng(1)]
    r.refused("e0", "t", "interactive", 2)
    r.refused("e1", "t", "interactive", 1)
    req = GenerateRequest(request_id="r1", prompt_token_ids=[1, 2], priority="interactive", tenant="t")

    async def first():
        # No HTTP client at all: asking an engine would fail with AttributeError, not refuse.
        return await anext(open_choice(None, r, engines, req, 0, result := StreamResult(), lambda: 0.0)), result

    with pytest.raises(NoEngineAvailable) as exc:
        asyncio.run(first())
    assert exc.value.code == "engine_overloaded" and exc.value.retry_after == 1
