"""Scheduler policy on the CPU without a model: budgets, decode-first, chunking, priority, preemption."""
import dataclasses

import pytest

from services.engine.config import ConfigError, SchedulerConfig
from services.engine.kv.block_pool import BlockPool
from services.engine.kv.manager import KVCacheManager
from services.engine.scheduler import Scheduler, StepPlan
from services.engine.sequence import Priority, SamplingParams, Sequence, Status


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=16, chunked=True, max_len=256) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, chunked_prefill=chunked)
    return Scheduler(cfg, kv, max_len)


def make_seq(rid: str, prompt_len: int, max_tokens=8, priority=Priority.INTERACTIVE, first_token=1) -> Sequence:
    prompt = [first_token + i for i in range(prompt_len)]
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), seed=0, priority=priority)


def advance(sched: Scheduler, plan: StepPlan, token=7) -> None:
    """What the engine does after a forward: count computed tokens, append sampled ones, finish."""
    for s in plan.scheduled:
        s.seq.num_computed_tokens = s.start + s.num_new_tokens
        sched.kv.commit(s.seq)
        if s.samples:
            s.seq.token_ids.append(token)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")


def test_decodes_are_scheduled_before_a_long_prefill_and_the_prefill_is_chunked():
    sched = make_scheduler(budget=16)
    short = make_seq("short", 3)
    sched.add(short)
    advance(sched, sched.schedule())  # short is now decoding
    long = make_seq("long", 40)
    sched.add(long)
    plan = sched.schedule()
    by_id = {s.seq.request_id: s for s in plan.scheduled}
    assert by_id["short"].num_new_tokens == 1
    assert by_id["long"].num_new_tokens == 15 and not by_id["long"].samples
    assert plan.num_batched_tokens == 16
    advance(sched, plan)
    plan = sched.schedule()
    by_id = {s.seq.request_id: s for s in plan.scheduled}
    assert by_id["short"].num_new_tokens == 1 and by_id["long"].start == 15


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=16, chunked=False)
    sched.add(make_seq("a", 10))
    sched.add(make_seq("b", 10))
    plan = sched.schedule()
    assert [s.seq.request_id for s in plan.scheduled] == ["a"]


def test_interactive_is_admitted_before_batch_regardless_of_arrival():
    sched = make_scheduler(budget=8)
    sched.add(make_seq("batch", 6, priority=Priority.BATCH))
    sched.add(make_seq("inter", 6, priority=Priority.INTERACTIVE))
    plan = sched.schedule()
    assert plan.scheduled[0].seq.request_id == "inter"
    assert plan.scheduled[0].num_new_tokens == 6


def test_preemption_picks_the_lowest_priority_latest_sequence_and_requeues_it_first():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a = make_seq("a", 8, max_tokens=20)
    b = make_seq("b", 8, max_tokens=20, priority=Priority.BATCH)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert {s.seq.request_id for s in plan.scheduled} == {"a"}  # b's prompt waits out a's first-token step
    advance(sched, plan)
    plan = sched.schedule()
    assert {s.seq.request_id for s in plan.scheduled} == {"a", "b"}
    preempted = []
    for _ in range(12):
        advance(sched, plan)
        plan = sched.schedule()
        preempted += [s.request_id for s in plan.preempted]
        sched.kv.check_integrity()
        if preempted:
            break
    assert preempted == ["b"]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.waiting[Priority.BATCH][0] is b
    assert a.status is Status.RUNNING


def test_waiting_interactive_preempts_running_batch_when_kv_is_short():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    batch = make_seq("batch", 12, priority=Priority.BATCH)
    sched.add(batch)
    advance(sched, sched.schedule())
    sched.add(make_seq("inter", 8))
    plan = sched.schedule()
    assert [s.request_id for s in plan.preempted] == ["batch"]
    assert [s.seq.request_id for s in plan.scheduled] == ["inter"]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_seqs=2, budget=64)
    for i in range(4):
        sched.add(make_seq(f"s{i}", 2))
    plan = sched.schedule()
    assert len(plan.scheduled) == 2 and sched.num_waiting == 2


def test_finish_frees_blocks_immediately_for_waiting_and_running():
    sched = make_scheduler()
    a, b = make_seq("a", 9), make_seq("b", 9)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.add(c := make_seq("c", 5))
    sched.finish(a, "abort")
    sched.finish(c, "abort")
    assert sched.kv.block_table("a") == []
    assert sched.num_waiting == 0 and sched.num_running == 1
    sched.finish(b, "abort")
    assert sched.kv.pool.num_used == 0
    sched.kv.check_integrity()


def test_prefix_hit_counts_cached_tokens_once_on_first_admission():
    sched = make_scheduler(budget=64)
    first = make_seq("first", 13, max_tokens=1)
    sched.add(first)
    advance(sched, sched.schedule())
    second = make_seq("second", 13, max_tokens=1)
    sched.add(second)
    plan = sched.schedule()
    assert second.num_cached_tokens == 12
    assert plan.scheduled[0].start == 12 and plan.scheduled[0].num_new_tokens == 1


def test_a_step_computing_an_interactive_prompt_holds_every_batch_row():
    sched = make_scheduler(budget=32)
    decoding = make_seq("b-decode", 3, max_tokens=20, priority=Priority.BATCH)
    sched.add(decoding)
    advance(sched, sched.schedule())  # b-decode is decoding now
    long = make_seq("b-long", 40, priority=Priority.BATCH, first_token=100)
    sched.add(long)
    advance(sched, sched.schedule())  # b-long prefilled in part
    assert 0 < long.num_computed_tokens < 40
    sched.add(make_seq("b-new", 5, priority=Priority.BATCH, first_token=200))
    sched.add(make_seq("inter", 6, first_token=300))
    batch_clock = sched.tenants.state(decoding).vtime
    plan = sched.schedule()
    # The interactive prompt's step: the batch decode, the batch prefill chunk and the admission all wait,
    # though the budget has room for them; the batch's virtual clock is not charged for the dropped decode.
    assert [s.seq.request_id for s in plan.scheduled] == ["inter"] and plan.num_batched_tokens == 6 < 32
    assert sched.tenants.state(decoding).vtime == batch_clock + 6  # one tenant here: inter's 6 tokens only
    advance(sched, plan)
    plan = sched.schedule()  # inter decodes now: the batch goes on
    assert {s.seq.request_id for s in plan.scheduled} == {"b-decode", "inter", "b-long", "b-new"}
    assert decoding.num_computed_tokens + 1 == decoding.num_tokens  # its decode was only put off a step


def test_an_interactive_request_that_cannot_start_does_not_hold_batch_decodes():
    """Only a step that really computes an interactive prompt is lean: an interactive request the step has no
    room for (here the batch's decodes fill the token budget, and decodes are never preempted for a prompt)
    holds nothing back, so a batch cannot be starved by a request that cannot start."""
    sched = make_scheduler(budget=2, max_seqs=4)
    for rid in ("b1", "b2"):
        sched.add(make_seq(rid, 1, max_tokens=20, priority=Priority.BATCH))
    advance(sched, sched.schedule())
    sched.add(make_seq("inter", 6, first_token=300))
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("b1", 1), ("b2", 1)]
    assert not plan.preempted and sched.num_waiting == 1  # inter waits for a step with room


def test_batch_prompt_work_per_step_is_capped_by_the_fitted_step_cost():
    """With `lower_class_prompt_s`, a step's batch prompt work is what that much compute buys by the fitted
    cost (pinned here: a prior no step can outweigh), never above the token cap, never below the floor."""
    from services.engine.class_yield import MIN_LOWER_CLASS_PROMPT_TOKENS, lower_class_prompt_tokens
    from services.engine.step_time import StepCostModel

    def pinned(per_token):
        return StepCostModel(fixed=1e-3, per_token=per_token, prior_weight=1e12)

    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, lower_class_prompt_s=0.002)
    assert lower_class_prompt_tokens(cfg, pinned(1e-4)) == 20  # 2 ms at 0.1 ms a token
    assert lower_class_prompt_tokens(cfg, pinned(1e-6)) == 128  # a fast device: the token cap rules
    assert lower_class_prompt_tokens(cfg, pinned(1e-3)) == MIN_LOWER_CLASS_PROMPT_TOKENS  # prompts keep moving
    assert lower_class_prompt_tokens(dataclasses.replace(cfg, lower_class_prefill_tokens=None), pinned(1e-6)) == 2000
    assert lower_class_prompt_tokens(dataclasses.replace(cfg, lower_class_prompt_s=None), None) == 128
    with pytest.raises(ConfigError, match="lower_class_prompt_s"):
        SchedulerConfig(lower_class_prompt_s=0)

    sched = Scheduler(cfg, KVCacheManager(BlockPool(64), 4), 256)
    assert sched.step_cost is not None and sched.step_bound is None
    sched.step_cost = pinned(1e-4)
    sched.add(make_seq("b1", 50, priority=Priority.BATCH))
    sched.add(make_seq("i1", 50, first_token=100))
    plan = sched.schedule()  # the interactive prompt is never capped; the batch waits for a step without it
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("i1", 50)]
    advance(sched, plan)
    plan = sched.schedule()
    assert sorted((s.seq.request_id, s.num_new_tokens) for s in plan.scheduled) == [("b1", 20), ("i1", 1)]


def test_batch_prompt_work_per_step_is_capped_chunks_included():
    kv = KVCacheManager(BlockPool(64), 4)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, lower_class_prefill_tokens=10)
    sched = Scheduler(cfg, kv, 256)
    sched.add(make_seq("b1", 8, priority=Priority.BATCH))
    sched.add(make_seq("b2", 30, priority=Priority.BATCH, first_token=100))
    sched.add(make_seq("b3", 4, priority=Priority.BATCH, first_token=200))
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("b1", 8), ("b2", 2)]  # 10, b3 waits
    advance(sched, plan)
    plan = sched.schedule()
    # b1 decodes (not prompt work); b2's next chunk and b3 share the cap.
    assert sorted((s.seq.request_id, s.num_new_tokens) for s in plan.scheduled) == [("b1", 1), ("b2", 10)]
    interactive = make_scheduler(budget=64)
    interactive.add(make_seq("i1", 40))  # interactive prompts are never capped
    assert interactive.schedule().scheduled[0].num_new_tokens == 40
