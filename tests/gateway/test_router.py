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
