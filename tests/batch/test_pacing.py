"""The pacer: more batch lines while the engines are idle, half as many as soon as interactive load shows."""
from __future__ import annotations

from services.batch.pacing import Pacer, PacingConfig
from services.common.engine_registry import EngineSnapshot


def engine(**kw) -> EngineSnapshot:
    return EngineSnapshot(id=kw.pop("id", "e0"), **kw)


def test_grows_by_one_while_idle_up_to_the_cap_per_engine():
    p = Pacer(PacingConfig(max_in_flight_per_engine=3))
    idle = [engine(id="a"), engine(id="b")]
    limits = [p.decide(idle, in_flight=p.limit).limit for _ in range(8)]
    assert limits == [2, 3, 4, 5, 6, 6, 6, 6]


def test_halves_on_each_sign_of_interactive_load_and_probes_again_after():
    cfg = PacingConfig(max_in_flight_per_engine=16, yield_kv_usage=0.8, yield_interactive_running=2)
    for pressure in (dict(waiting=9), dict(kv_usage=0.9), dict(running=8 + 3)):
        p = Pacer(cfg)
        p.limit = 8
        d = p.decide([engine(**pressure)], in_flight=8)
        assert (d.limit, d.yielding) == (4, True) and d.reason
        assert p.decide([engine(**pressure)], in_flight=4).limit == 2
        assert [p.decide([engine(**pressure)], in_flight=0).limit for _ in range(2)] == [1, 0]
        d = p.decide([engine(running=0)], in_flight=0)
        assert (d.limit, d.yielding) == (1, False)


def test_its_own_lines_are_not_counted_as_interactive_load():
    p = Pacer(PacingConfig(max_in_flight_per_engine=16, yield_interactive_running=2))
    p.limit = 10
    assert p.decide([engine(running=12)], in_flight=10).limit == 11  # 2 interactive: at the threshold, not over
    assert p.decide([engine(running=14)], in_flight=11).limit == 5  # 3 interactive


def test_no_engine_means_nothing_in_flight():
    p = Pacer(PacingConfig())
    assert p.decide([], in_flight=0).limit == 0


def test_one_step_per_heartbeat_not_per_question():
    p = Pacer(PacingConfig(max_in_flight_per_engine=16))
    beat = [engine(ts=100.0)]
    assert [p.decide(beat, in_flight=0).limit for _ in range(5)] == [2, 2, 2, 2, 2]  # the same figures, asked again
    assert p.decide([engine(ts=101.0)], in_flight=2).limit == 3
    busy = [engine(ts=102.0, waiting=4)]
    assert [p.decide(busy, in_flight=3).limit for _ in range(3)] == [1, 1, 1]  # halved once, not three times


def test_its_own_queued_lines_are_not_a_sign_of_load():
    p = Pacer(PacingConfig(max_in_flight_per_engine=16, yield_interactive_running=2))
    p.limit = 8
    assert p.decide([engine(running=5, waiting=3)], in_flight=8).limit == 9  # all eight are ours
    d = p.decide([engine(running=3, waiting=5)], in_flight=4)  # five wait, four are ours at most: one is not
    assert d.yielding and d.limit == 4
