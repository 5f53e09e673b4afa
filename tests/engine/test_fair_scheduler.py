"""Tenant-fair scheduling and SLO-aware admission.

Scheduler-level (no model): a tenant with one request is seated at once beside a tenant flooding the
batch, shares follow weights, interactive takes seats from batch, no two tenants take seats back and forth;
FCFS is the baseline. Engine-level (tiny model): fair preemption leaves every request's tokens identical to
running it alone (greedy and seeded), integrity holds every step; admission refuses what cannot meet its
budget and clamps batch work under overload.
"""
from __future__ import annotations

import collections
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.wire import EngineUnavailable
from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from services.engine.engine import LLMEngine
from services.engine.kv.block_pool import BlockPool
from services.engine.kv.manager import KVCacheManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import Priority, SamplingParams, Sequence, Status
from tests.engine.test_scheduler import advance


def make_scheduler(policy="fair", max_seqs=4, num_blocks=256, block_size=4, budget=64) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy), kv, 1024)


def seq(rid: str, tenant: str, prompt_len=6, max_tokens=30, weight=1.0, priority=Priority.INTERACTIVE) -> Sequence:
    s = Sequence(rid, [(hash(rid) + i) % 97 + 1 for i in range(prompt_len)],
                 SamplingParams(max_tokens=max_tokens, temperature=0), seed=0, priority=priority)
    s.tenant, s.weight = tenant, weight
    return s


def run(sched: Scheduler, steps: int, arrivals: dict[int, list[Sequence]] | None = None):
    """Step the scheduler; returns per step the running tenants, and when each request first ran."""
    first_run: dict[str, int] = {}
    seats: list[collections.Counter] = []
    for t in range(steps):
        for s in (arrivals or {}).get(t, []):
            sched.add(s)
        plan = sched.schedule()
        for x in plan.scheduled:
            first_run.setdefault(x.seq.request_id, t)
        seats.append(collections.Counter(s.tenant for s in sched.running))
        advance(sched, plan)
        sched.kv.check_integrity()
        sched.tenants.check_integrity(sched.running, (s for q in sched.waiting.values() for s in q))
    return seats, first_run


def test_a_tenant_with_one_request_is_seated_at_once_beside_a_flood():
    sched = make_scheduler(max_seqs=4)
    flood = {0: [seq(f"a{i}", "A") for i in range(30)]}
    flood[5] = [seq("b0", "B", max_tokens=5)]
    seats, first = run(sched, 12, flood)
    assert seats[4]["A"] == 4
    assert first["b0"] == 5  # the step it arrived: an A sequence gave up its seat
    assert seats[5] == {"A": 3, "B": 1}


def test_another_tenants_prompt_is_not_held_behind_a_floods_prefill_chunks():
    """A's 16 long prompts take 8 steps of prefill budget; B's short prompt arrives during them and gets its
    first token in the next step under fair sharing, not after every A chunk (as under FCFS)."""
    for policy, expect_within in (("fair", 1), ("fcfs", 7)):
        sched = make_scheduler(policy=policy, max_seqs=32, budget=64)
        arrivals = {0: [seq(f"a{i}", "A", prompt_len=32) for i in range(16)], 1: [seq("b0", "B", prompt_len=6)]}
        b = arrivals[1][0]
        sampled_at = None
        for t in range(12):
            for x in arrivals.get(t, []):
                sched.add(x)
            plan = sched.schedule()
            if any(s.seq is b and s.samples for s in plan.scheduled) and sampled_at is None:
                sampled_at = t
            advance(sched, plan)
        if policy == "fair":
            assert sampled_at == 1 + expect_within - 1, (policy, sampled_at)
        else:
            assert sampled_at >= expect_within, (policy, sampled_at)


def test_under_fcfs_the_same_request_waits_for_the_flood():
    sched = make_scheduler(policy="fcfs", max_seqs=4)
    flood = {0: [seq(f"a{i}", "A") for i in range(30)]}
    flood[5] = [seq("b0", "B", max_tokens=5)]
    seats, first = run(sched, 300, flood)
    assert first["b0"] > 200  # after the 30 of A's queued before it, 4 at a time, 30 steps each
    assert all(s.get("B", 0) == 0 for s in seats[5:200])


@pytest.mark.parametrize("weights,expect", [((1.0, 1.0), (4, 4)), ((3.0, 1.0), (6, 2))])
def test_backlogged_tenants_share_the_batch_by_weight(weights, expect):
    sched = make_scheduler(max_seqs=8)
    arrivals = {0: [seq(f"a{i}", "A", max_tokens=200, weight=weights[0]) for i in range(20)],
                3: [seq(f"b{i}", "B", max_tokens=200, weight=weights[1]) for i in range(20)]}
    seats, _ = run(sched, 40, arrivals)
    assert (seats[-1]["A"], seats[-1]["B"]) == expect


def test_equal_tenants_get_equal_service_over_time():
    sched = make_scheduler(max_seqs=4, budget=8)
    arrivals = {0: [seq(f"a{i}", "A", max_tokens=6) for i in range(40)],
                0.5: [], 1: [seq(f"b{i}", "B", max_tokens=6) for i in range(40)]}
    run(sched, 60, arrivals)
    va, vb = (sched.tenants.states[k].vtime for k in ("A", "B"))
    assert abs(va - vb) / max(va, vb) < 0.15, (va, vb)


def test_interactive_takes_a_seat_from_batch_and_batch_never_from_interactive():
    sched = make_scheduler(max_seqs=2)
    arrivals = {0: [seq("batch0", "A", priority=Priority.BATCH), seq("batch1", "A", priority=Priority.BATCH)],
                2: [seq("inter", "A", max_tokens=4)],
                3: [seq("batch2", "B", priority=Priority.BATCH)]}
    inter = arrivals[2][0]
    seats, first = run(sched, 6, arrivals)
    assert first["inter"] == 2  # took a batch sequence's seat at once
    # B's batch request takes A's remaining batch seat (B is under its share), never the interactive one.
    assert first["batch2"] == 3 and inter.num_preemptions == 0
    assert [r.request_id for r in sched.running] == ["inter", "batch2"] or inter.status is Status.FINISHED


def test_two_tenants_never_take_seats_back_and_forth():
    sched = make_scheduler(max_seqs=5)
    arrivals = {0: [seq(f"a{i}", "A", max_tokens=400) for i in range(10)],
                1: [seq(f"b{i}", "B", max_tokens=400) for i in range(10)]}
    run(sched, 60, arrivals)
    assert sched.num_preemptions <= 3  # B takes its share once; nobody takes it back


@given(ops=st.lists(st.tuples(st.sampled_from("ABC"), st.integers(1, 12), st.integers(1, 20), st.sampled_from(list(Priority)),
                              st.floats(0.5, 4)), min_size=1, max_size=40),
       max_seqs=st.integers(1, 6), blocks=st.integers(8, 64))
@settings(max_examples=150, deadline=None)
def test_any_mix_keeps_counts_and_blocks_consistent_and_finishes(ops, max_seqs, blocks):
    sched = make_scheduler(max_seqs=max_seqs, num_blocks=blocks, block_size=4, budget=16)
    seqs = [seq(f"r{i}", t, p, m, w, pr) for i, (t, p, m, pr, w) in enumerate(ops)]
    arrivals: dict[int, list[Sequence]] = collections.defaultdict(list)
    for i, s in enumerate(seqs):
        arrivals[i // 3].append(s)
    for t in range(400):
        for s in arrivals.get(t, []):
            if s.num_tokens + s.params.max_tokens > blocks * 4:
                continue
            sched.add(s)
        plan = sched.schedule()
        advance(sched, plan)
        sched.kv.check_integrity()
        sched.tenants.check_integrity(sched.running, (s for q in sched.waiting.values() for s in q))
        if not sched.has_unfinished() and t > len(arrivals):
            break
    assert not sched.has_unfinished() and not sched.tenants.states
    assert all(s.status is Status.FINISHED for s in seqs if s.num_tokens + s.params.max_tokens - s.num_output_tokens
               <= blocks * 4)


# -- the engine -------------------------------------------------------------------------------------------
def make_engine(model, max_seqs=3, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model_dir=model, cache=CacheConfig(block_size=16, memory_bytes=64 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=256, **sched),
        lora=LoraConfig(),
    ))


def _requests():
    out = []
    for i in range(6):
        params = SamplingParams(max_tokens=24, temperature=0 if i % 2 else 0.8, seed=100 + i, ignore_eos=True)
        out.append((f"a{i}", "tenant-a", [(11 * i + j) % 400 + 20 for j in range(10 + i)], params))
    for i in range(2):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        out.append((f"b{i}", "tenant-b", [(7 * i + j) % 300 + 50 for j in range(8)], params))
    return out


def test_fair_preemption_leaves_every_request_token_identical(tiny_model):
    reference: dict[str, list[int]] = {}
    for rid, tenant, prompt, params in _requests():  # each alone: no batching, no preemption
        e = make_engine(tiny_model, max_seqs=1)
        e.add_request(rid, prompt, params, tenant=tenant)
        reference[rid] = _drain(e)[rid]
    engine = make_engine(tiny_model, max_seqs=3)
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    reqs = _requests()
    for rid, tenant, prompt, params in reqs[:6]:
        engine.add_request(rid, prompt, params, tenant=tenant)
    for step in range(400):
        if step == 3:
            for rid, tenant, prompt, params in reqs[6:]:
                engine.add_request(rid, prompt, params, tenant=tenant)
        for o in engine.step():
            assert o.error is None
            tokens[o.request_id] += o.new_token_ids
        engine.check_integrity()
        engine.scheduler.tenants.check_integrity(engine.scheduler.running,
                                                 (s for q in engine.scheduler.waiting.values() for s in q))
        if not engine.has_unfinished():
            break
    assert engine.scheduler.num_preemptions > 0 and engine.metrics.fair_preemptions._value.get() > 0
    assert dict(tokens) == reference


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = collections.defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def _observe_steps(sched: Scheduler, tracker, steps: int, step_s: float, arrive=None) -> None:
    """Step the scheduler as the engine would, folding each step into the admission tracker."""
    for t in range(steps):
        for s in (arrive(t) if arrive else []):
            sched.add(s)
        before = sched.num_finished
        advance(sched, sched.schedule())
        tracker.observe(sched, step_s, sched.num_finished - before)


def test_a_quiet_spells_trickle_does_not_price_the_next_bursts_queue():
    """The finish rate is how fast seats free up in a full batch: a lone request finishing now and then
    (seats to spare) is not that rate, and must not get the next burst's queue refused. Seconds of a
    saturated batch are."""
    from services.engine.admission import LoadTracker

    sched = make_scheduler(max_seqs=4, budget=64)
    tracker = LoadTracker(sched.config)
    sched.config = dataclasses.replace(sched.config, interactive_ttft_slo_s=0.3)
    tracker.config = sched.config
    # 5 s of a trickle: one 3-token request at a time (a seat frees every 4 steps of 50 ms, batch never full).
    _observe_steps(sched, tracker, 100, 0.05, lambda t: [seq(f"q{t}", "A", max_tokens=3)] if not sched.running else [])
    assert tracker.snapshot.finish_rate is None
    # A burst: 4 seated, the rest queued. Nobody has waited yet and the rate is unknown: the queue is admitted.
    _observe_steps(sched, tracker, 1, 0.05, lambda t: [seq(f"b{i}", "A", max_tokens=40) for i in range(12)])
    assert tracker.snapshot.free_seats == 0 and sum(tracker.snapshot.waiting.values()) >= 8
    tracker.snapshot = dataclasses.replace(tracker.snapshot, oldest={k: __import__("time").monotonic()
                                                                     for k in tracker.snapshot.oldest})
    tracker.check("A", 1.0, Priority.INTERACTIVE, 6)
    # Saturated long enough to trust: a seat frees about every 10 steps (0.5 s); 9 seats ahead -> refused.
    _observe_steps(sched, tracker, 60, 0.05, lambda t: [seq(f"c{t}", "A", max_tokens=40)])
    rate = tracker.snapshot.finish_rate
    assert rate is not None and 1.0 < rate < 4.0, rate
    with pytest.raises(EngineUnavailable):
        tracker.check("A", 1.0, Priority.INTERACTIVE, 6)


def test_admission_refuses_over_budget_with_retry_after_and_not_a_tenant_under_its_share(tiny_model):
    engine = make_engine(tiny_model, max_seqs=2, interactive_ttft_slo_s=0.5)
    for i in range(12):
        engine.add_request(f"a{i}", [20 + i, 21, 22, 23], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                           tenant="A")
    for _ in range(6):
        engine.step()
    # Make the measured rates those of a saturated engine: a seat frees every 2 s, steps take 50 ms.
    snap = engine.load.snapshot
    assert snap.free_seats == 0 and sum(snap.waiting.values()) == 10
    engine.load.snapshot = dataclasses.replace(snap, finish_rate=0.5, step_s=0.05)
    with pytest.raises(EngineUnavailable) as exc:
        engine.load.check("A", 1.0, Priority.INTERACTIVE, 4)
    assert exc.value.code == "engine_overloaded" and exc.value.retry_after >= 1
    engine.load.check("B", 1.0, Priority.INTERACTIVE, 4)  # B is under its share: it will be seated by preemption
    engine.load.check("A", 1.0, Priority.BATCH, 4)  # the batch class's budget (600 s) is not over
    # Not observed long enough to tell, and nobody has waited yet (the oldest arrived just now -- the test's
    # six steps may take seconds on a loaded machine, and that observed wait alone would refuse): admitted.
    now = __import__("time").monotonic()
    engine.load.snapshot = dataclasses.replace(snap, finish_rate=None, step_s=0.05, oldest={k: now for k in snap.oldest})
    engine.load.check("A", 1.0, Priority.INTERACTIVE, 4)
    assert engine.load.overloaded()


def test_batch_requests_are_clamped_under_sustained_overload_and_say_so(tiny_model):
    engine = make_engine(tiny_model, max_seqs=2, batch_max_tokens_under_overload=8)
    engine.load.mark_overloaded(__import__("time").monotonic())
    seq = engine.add_request("b", [20, 21, 22], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                             priority=Priority.BATCH)
    inter = engine.add_request("i", [20, 21, 22], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    outs = _collect(engine)
    assert seq.params.max_tokens == 8 and seq.clamped_from == 40 and len(outs["b"]) == 8
    assert inter.params.max_tokens == 40 and len(outs["i"]) == 40


def _collect(engine):
    out = collections.defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.request_id == "b" and o.finished:
                assert o.finish_reason == "length" and o.clamped_from == 40
    return out


def test_a_frontend_refuses_over_budget_work_itself_and_the_core_counts_it(tiny_model):
    """Split path: the core sends its admission snapshot (Load) to the front-end, which refuses over-budget
    work at once -- no round trip through the step loop -- with Retry-After, and tells the core (Shed), which
    counts the refusal and marks itself overloaded. Work within budget still runs."""
    import asyncio
    import time

    from tests.engine.conftest import collect, split_engine

    config = EngineConfig(model_dir=tiny_model, cache=CacheConfig(block_size=16, memory_bytes=64 * 2**20),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, interactive_ttft_slo_s=5.0),
                          lora=LoraConfig())
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def main():
        async with split_engine(config) as (client, _):
            assert client.admission is not None and client.admission.config.interactive_ttft_slo_s == 5.0
            await collect(client, "warm", [20, 21, 22], params, tenant="A")
            assert client.admission.snapshot.at > 0  # Loads arrive after steps
            # As if the core were saturated by tenant A: no free seat, 10 waiting, a seat frees every 20 s.
            now = time.monotonic()
            client.admission.snapshot = dataclasses.replace(
                client.admission.snapshot, free_seats=0, finish_rate=0.05, step_s=0.05, running={"A": 2},
                weights={"A": 1.0}, waiting={(int(Priority.INTERACTIVE), "A"): 10},
                oldest={(int(Priority.INTERACTIVE), "A"): now})
            with pytest.raises(EngineUnavailable) as exc:
                await collect(client, "refused", [20, 21, 22], params, tenant="A")
            assert exc.value.code == "engine_overloaded" and exc.value.retry_after >= 1
            metrics = (await client.op("metrics")).decode()
            shed = [line for line in metrics.splitlines() if line.startswith("mplex_engine_shed_total")]
            assert shed and float(shed[0].split()[-1]) == 1.0
            # Tenant B is under its share: the front-end lets it through and the core serves it.
            out = await collect(client, "b", [20, 21, 22], params, tenant="B")
            assert len(out.new_token_ids) == 4 and await client.op("num_in_flight") == 0

    asyncio.run(main())
