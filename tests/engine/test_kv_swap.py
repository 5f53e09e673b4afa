"""The KV cache as virtual memory, without a model: swap to the host tier and back, forks that share a
prompt's blocks copy-on-write, the ordered block copies, and -- under hypothesis -- random request
mixes and pool sizes run through the real scheduler and KV manager against a fake KV store that
records what every block slot holds, so a lost, stale or shared-and-overwritten slot is caught."""
from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.engine.config import SchedulerConfig
from services.engine.kv.block_pool import BlockPool
from services.engine.kv.copies import BlockCopy, CopyKind, copy_batches
from services.engine.kv.host_pool import HostBlockPool
from services.engine.kv.manager import FROM_HOST, KVCacheManager
from services.engine.preemption import PreemptionCostModel, PreemptKind
from services.engine.scheduler import Scheduler, StepPlan
from services.engine.sequence import Priority, SamplingParams, Sequence, Status
from tests.engine.test_kv_manager import Req, run_prefill


def make_kv(num_blocks=16, block_size=4, host_blocks=16, prefix_caching=True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), block_size, prefix_caching, HostBlockPool(host_blocks))


# -- the host pool and the copy order ------------------------------------------------------------

def test_host_pool_round_trip_and_integrity():
    host = HostBlockPool(3)
    a, b = host.allocate(), host.allocate()
    host.check_integrity([a, b])
    host.release([a])
    assert host.num_free == 2 and host.num_used == 1
    with pytest.raises(AssertionError):
        host.release([a])
    with pytest.raises(AssertionError):
        host.check_integrity([a, b])


def _run_one_by_one(ops, dev, host):
    for op in ops:
        if op.kind is CopyKind.SWAP_OUT:
            host[op.dst] = dev[op.src]
        elif op.kind is CopyKind.SWAP_IN:
            dev[op.dst] = host[op.src]
        else:
            dev[op.dst] = dev[op.src]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(CopyKind)), st.integers(0, 5), st.integers(0, 5)), max_size=30))
def test_batched_copies_equal_copies_one_by_one(raw):
    ops = [BlockCopy(k, s, d) for k, s, d in raw if not (k is CopyKind.COW and s == d)]
    dev, host = list(range(6)), list(range(100, 106))
    want_dev, want_host = dev[:], host[:]
    _run_one_by_one(ops, want_dev, want_host)
    for batch in copy_batches(ops):  # each batch as one gather then one scatter, as the runner does
        src_tier = host if batch.kind is CopyKind.SWAP_IN else dev
        dst_tier = host if batch.kind is CopyKind.SWAP_OUT else dev
        values = [src_tier[s] for s in batch.src]
        for d, v in zip(batch.dst, values):
            dst_tier[d] = v
    assert (dev, host) == (want_dev, want_host)


def test_runner_copies_move_every_kv_block_tensor(tiny_model):
    from tests.engine.conftest import make_engine

    engine = make_engine(tiny_model, block_size=4, num_blocks=8)
    runner = engine.runner
    tensors = runner.kv_block_tensors()
    assert len(tensors) == 2 * len(runner.kv_caches) and len(runner.host_blocks) == len(tensors)
    for i, t in enumerate(tensors):
        t.copy_(torch.randn_like(t) + i)
    before = [t.clone() for t in tensors]
    stats = runner.copy_blocks([BlockCopy(CopyKind.SWAP_OUT, 1, 0), BlockCopy(CopyKind.SWAP_OUT, 2, 1),
                                BlockCopy(CopyKind.COW, 3, 1),  # block 1 was read by a swap-out first
                                BlockCopy(CopyKind.SWAP_IN, 0, 5), BlockCopy(CopyKind.SWAP_IN, 1, 6)])
    for t, b in zip(tensors, before):
        assert torch.equal(t[1], b[3]) and torch.equal(t[5], b[1]) and torch.equal(t[6], b[2])
        assert torch.equal(t[0], b[0]) and torch.equal(t[7], b[7])
    assert (stats.swap_out_blocks, stats.swap_in_blocks, stats.cow_blocks) == (2, 2, 1)
    assert stats.swap_bytes == 4 * runner.block_bytes


def test_an_fp8_cache_swaps_and_forks_with_its_scales(tiny_model):
    """fp8 K/V move as bytes and their per-block scales move with them: an fp8 engine forced to swap under a
    tiny pool, and forking n=3 choices, gives exactly the tokens of the same fp8 engine without preemption
    (fp8 KV is deterministic), with integrity checked every step."""
    from services.engine.sequence import SamplingParams
    from tests.engine.conftest import make_engine

    prompts = [[(13 * i + j) % 400 + 20 for j in range(9 + 3 * i)] for i in range(5)] + [[31, 32, 33, 34, 35]] * 3
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    def run(**kw):
        engine = make_engine(tiny_model, kv_dtype="fp8", **kw)
        assert len(engine.runner.kv_block_tensors()) == 4 * len(engine.runner.kv_caches)  # K, V and two scales
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for o in engine.step():
                assert o.error is None
                out[o.request_id] += o.new_token_ids
            engine.check_integrity()
        return engine, out

    _, reference = run(prompt_sharing=False)
    engine, swapped = run(block_size=4, num_blocks=24, preemption_mode="swap")
    assert engine.scheduler.preemptions_by_kind[PreemptKind.SWAP] > 0 and engine.scheduler.num_forks > 0
    assert swapped == reference


# -- forks and copy-on-write in the KV manager ----------------------------------------------------

def test_fork_shares_the_partial_block_and_the_first_write_copies_it():
    kv = make_kv(block_size=4)
    prompt = list(range(10))  # blocks: [0..3] [4..7] [8, 9 | partial]
    leader = Req("l", prompt)
    run_prefill(kv, leader)
    follower = Req("f", prompt)
    hit = kv.fork(leader, len(prompt) - 1)
    assert hit.block_ids == tuple(kv.block_table("l")) and hit.num_tokens == 9
    used = kv.pool.num_used
    assert kv.allocate(follower, 1, hit)  # recomputes token 9, in the shared partial block: copied first
    assert kv.pool.num_used == used + 1
    (cow,) = kv.take_copies()
    assert cow == BlockCopy(CopyKind.COW, kv.block_table("l")[2], kv.block_table("f")[2])
    assert kv.block_table("f")[:2] == kv.block_table("l")[:2]
    assert [kv.pool.blocks[b].ref_cnt for b in kv.block_table("l")] == [2, 2, 1]
    kv.check_integrity()
    # The leader now writes its block 2 in place: nobody else holds it.
    leader.tokens.append(77)
    assert kv.allocate(leader, 1) and kv.take_copies() == []
    kv.free("l")
    kv.free("f")
    assert kv.pool.num_used == 0
    kv.check_integrity()


def test_fork_at_a_block_boundary_copies_nothing_and_a_full_cached_block_is_copied_on_write():
    kv = make_kv(block_size=4)
    run_prefill(kv, leader := Req("l", list(range(9))))  # token 8 starts block 2: the fork shares 2 full blocks
    assert kv.allocate(Req("f", list(range(9))), 1, kv.fork(leader, 8)) and kv.take_copies() == []
    run_prefill(kv, leader2 := Req("l2", list(range(50, 58))))  # 8 tokens: token 7 ends the full, cached block 1
    assert kv.pool.blocks[kv.block_table("l2")[1]].hash is not None
    assert kv.allocate(Req("f2", list(range(50, 58))), 1, kv.fork(leader2, 7))
    assert [c.kind for c in kv.take_copies()] == [CopyKind.COW]  # the cached block stays read-only
    kv.check_integrity()


# -- swap out and back in --------------------------------------------------------------------------

def test_swap_out_moves_private_blocks_and_leaves_shared_cached_ones():
    kv = make_kv(block_size=4, host_blocks=8)
    system = list(range(8))
    run_prefill(kv, other := Req("other", system + [100, 101]))
    victim = Req("v", system + [200, 201, 202, 203, 204])
    assert run_prefill(kv, victim) == 8  # two shared cached blocks, then two of its own
    est = kv.swap_estimate(victim)
    assert (est.copy_blocks, est.recompute_tokens, est.host_room) == (2, 5, True)
    table = kv.block_table("v")
    kv.swap_out(victim)
    copies = kv.take_copies()
    # Its own full block 2 (cached, but held by it alone) and its partial block 3 are copied out.
    assert copies == [BlockCopy(CopyKind.SWAP_OUT, table[2], 0), BlockCopy(CopyKind.SWAP_OUT, table[3], 1)]
    assert kv.host.num_used == 2 and kv.block_table("v") == [] and kv.is_swapped("v")
    kv.check_integrity()
    hit = kv.restore(victim)
    # Nothing evicted block 2 meanwhile: it comes back from the prefix cache, only block 3 from the host.
    assert hit.kind == "swap" and hit.num_tokens == 13
    assert hit.block_ids == (*table[:3], FROM_HOST) and hit.host_ids[3] == 1
    assert kv.allocate(victim, 1, hit)
    (back,) = kv.take_copies()
    assert back.kind is CopyKind.SWAP_IN and back.src == 1
    assert kv.host.num_used == 0 and not kv.is_swapped("v")
    assert kv.block_table("v")[:3] == table[:3]
    kv.check_integrity()

    # Under pressure the private cached block is evicted while it is out: it comes back from the host.
    kv.swap_out(victim)
    kv.take_copies()
    assert kv.allocate(filler := Req("filler", list(range(900, 900 + 4 * kv.pool.num_free))), 4 * kv.pool.num_free)
    kv.free(filler.request_id)
    hit = kv.restore(victim)
    assert hit.block_ids == (*table[:2], FROM_HOST, FROM_HOST) and hit.num_tokens == 13
    assert kv.allocate(victim, 1, hit)
    assert [c.kind for c in kv.take_copies()] == [CopyKind.SWAP_IN] * 2
    kv.check_integrity()
    del other


def test_a_shared_block_evicted_while_swapped_out_is_recomputed_from_there():
    kv = make_kv(num_blocks=6, block_size=4, host_blocks=8)
    system = list(range(8))
    run_prefill(kv, Req("other", system + [1]))
    run_prefill(kv, victim := Req("v", system + [5, 6, 7]))
    kv.swap_out(victim)
    kv.take_copies()
    kv.free("other")  # the shared blocks are now only cached ...
    assert kv.allocate(Req("big", list(range(500, 524))), 24)  # ... and evicted
    kv.free("big")
    hit = kv.restore(victim)
    assert hit.num_tokens == 0 and hit.block_ids == ()  # nothing left before the hole: recompute it all
    assert kv.allocate(victim, 11, hit)
    assert kv.host.num_used == 0
    kv.check_integrity()


def test_a_restore_never_evicts_a_cached_block_it_is_about_to_share():
    """Regression: allocating the blocks that come back from the host must not evict an idle cached
    block the same restore shares (it was listed twice in the table)."""
    kv = make_kv(num_blocks=4, block_size=4, host_blocks=4)
    run_prefill(kv, v := Req("v", list(range(8)) + [50]))  # v0, v1 cached; v2 partial
    v0, v1, _ = kv.block_table("v")
    kv.swap_out(v)
    kv.take_copies()
    kv.pool.acquire(v1)  # keep v1 while a filler evicts the rest, v0 included ...
    run_prefill(kv, filler := Req("filler", list(range(100, 112))))
    kv.pool.release([v1])  # ... so v1 is now the least recently freed: the first a new block would take
    kv.free(filler.request_id)
    hit = kv.restore(v)
    assert hit.block_ids == (FROM_HOST, v1, FROM_HOST)
    assert kv.allocate(v, 1, hit)
    table = kv.block_table("v")
    assert table[1] == v1 and len(set(table)) == 3
    kv.check_integrity()


def test_free_of_a_swapped_request_returns_its_host_blocks():
    kv = make_kv(block_size=4, host_blocks=4)
    run_prefill(kv, r := Req("r", list(range(11))))
    kv.swap_out(r)
    assert kv.host.num_used == 3
    kv.free("r")
    assert kv.host.num_used == 0 and not kv.is_swapped("r") and kv.pool.num_used == 0
    kv.check_integrity()


def test_no_host_room_means_recompute():
    kv = make_kv(block_size=4, host_blocks=2)
    run_prefill(kv, r := Req("r", list(range(11))))
    assert not kv.swap_estimate(r).host_room
    model = PreemptionCostModel(block_bytes=1024)
    model.observe_copy(1, 1.0)  # absurdly slow copies: recompute would win anyway
    assert model.choose(kv.swap_estimate(r)) is PreemptKind.RECOMPUTE


def test_cost_model_picks_the_cheaper_way():
    model = PreemptionCostModel(block_bytes=1000)
    from services.engine.kv.manager import SwapEstimate

    est = SwapEstimate(num_tokens=64, copy_blocks=4, recompute_tokens=64, host_room=True)
    model.observe_copy(8000, 1e-6)  # 8 GB/s: 8000 bytes each way take 1 us
    model.observe_step(prefill_tokens=100, batched_tokens=100, seconds=0.01)  # 100 us a token
    assert model.choose(est) is PreemptKind.SWAP
    assert model.last.swap_seconds == pytest.approx(1e-6) and model.last.recompute_seconds == pytest.approx(64e-4)
    slow = PreemptionCostModel(block_bytes=1000)
    slow.observe_copy(8000, 1.0)  # 8 kB/s
    slow.observe_step(100, 100, 0.01)
    assert slow.choose(est) is PreemptKind.RECOMPUTE
    assert slow.decisions == {PreemptKind.SWAP: 0, PreemptKind.RECOMPUTE: 1}


# -- the scheduler, the KV manager and the block copies together, against a fake KV store ---------

class FakeKV:
    """What the runner would hold: every device and host block slot records the (cache extra, token
    prefix hash) of the KV written there. The step's copies run in order, then the forward writes each
    scheduled token's slot, after checking that every slot it attends to holds its own prefix's KV."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        bs = kv.block_size
        self.dev = [[None] * bs for _ in range(kv.pool.num_blocks)]
        self.host = [[None] * bs for _ in range(kv.host.num_blocks if kv.host else 0)]

    @staticmethod
    def content(seq: Sequence, pos: int):
        return (seq.cache_extra, hash(tuple(seq.token_ids[: pos + 1])))

    def run(self, plan: StepPlan) -> None:
        for c in plan.block_copies:
            src = self.host if c.kind is CopyKind.SWAP_IN else self.dev
            dst = self.host if c.kind is CopyKind.SWAP_OUT else self.dev
            dst[c.dst] = list(src[c.src])
        bs = self.kv.block_size
        written = set()
        for s in plan.scheduled:
            table = s.block_table
            for pos in range(s.start):
                got = self.dev[table[pos // bs]][pos % bs]
                assert got == self.content(s.seq, pos), f"{s.seq.request_id} reads a wrong slot at {pos}"
            for pos in range(s.start, s.start + s.num_new_tokens):
                b = table[pos // bs]
                block = self.kv.pool.blocks[b]
                # Copy-on-write: a block is written only by its one holder, and never once cached.
                assert block.ref_cnt == 1 and block.hash is None, f"write into shared/cached block {b}"
                assert (b, pos % bs) not in written
                written.add((b, pos % bs))
                self.dev[b][pos % bs] = self.content(s.seq, pos)


class RandomPolicy:
    def __init__(self, rng: random.Random, p_swap: float):
        self.rng, self.p_swap = rng, p_swap

    def choose(self, est) -> PreemptKind:
        return PreemptKind.SWAP if est.host_room and self.rng.random() < self.p_swap else PreemptKind.RECOMPUTE


def next_token(seq: Sequence) -> int:
    """A deterministic 'sample': the same prefix gives the same token, as greedy decoding would."""
    return hash((seq.cache_extra, tuple(seq.token_ids))) % 50 + 1000


request_st = st.tuples(
    st.integers(0, 3),  # prompt family: same family, same salt = identical prompts, which fork each other
    st.integers(1, 12),  # max tokens
    st.sampled_from(list(Priority)),
    st.sampled_from(["", "", "", "tenant-b"]),  # cache salt
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.none(), st.none(), st.integers(0, 40)),  # abort at step
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_st, min_size=3, max_size=16),
    family_lengths=st.lists(st.integers(1, 22), min_size=4, max_size=4),
    num_blocks=st.integers(6, 24),
    host_blocks=st.integers(0, 24),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(3, 40),
    p_swap=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    prefix_caching=st.booleans(),
    share=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_mixes_keep_every_invariant_and_every_slot_right(
    requests, family_lengths, num_blocks, host_blocks, block_size, budget, p_swap, prefix_caching, share, seed
):
    kv = KVCacheManager(BlockPool(num_blocks), block_size, prefix_caching, HostBlockPool(host_blocks))
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), kv, 256,
                      preemption=RandomPolicy(random.Random(seed), p_swap), share_prompts=share)
    store = FakeKV(kv)
    # Families share their first tokens, so different families also hit each other's cached blocks.
    families = {f: [1 + i for i in range(6)] + [7 * f + 3 * i % 11 for i in range(16)] for f in range(4)}
    arrivals: dict[int, list[Sequence]] = defaultdict(list)
    aborts: dict[int, list[Sequence]] = defaultdict(list)
    for i, (fam, max_tokens, prio, salt, at, abort_at) in enumerate(requests):
        plen = family_lengths[fam]
        if -(-(plen + max_tokens) // block_size) > num_blocks:
            continue  # the engine refuses these up front
        seq = Sequence(f"r{i}", families[fam][:plen], SamplingParams(max_tokens=max_tokens, temperature=0), seed=0,
                       priority=prio, cache_salt=salt)
        arrivals[at].append(seq)
        if abort_at is not None:
            aborts[abort_at].append(seq)
    expected = {}  # the tokens each request gets when it runs alone: forks and swaps must not change them
    for seqs in arrivals.values():
        for seq in seqs:
            probe = Sequence("probe", list(seq.prompt_token_ids), seq.params, 0, cache_salt=seq.cache_salt)
            for _ in range(seq.params.max_tokens):
                probe.token_ids.append(next_token(probe))
            expected[seq.request_id] = probe.output_token_ids
    live: list[Sequence] = []
    for step in range(600):
        for seq in arrivals.pop(step, []):
            sched.add(seq)
            live.append(seq)
        for seq in aborts.pop(step, []):
            if not seq.is_finished and seq in live:
                sched.finish(seq, "abort")
        plan = sched.schedule()
        store.run(plan)
        for s in plan.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
            kv.commit(s.seq)
            if s.samples:
                s.seq.token_ids.append(next_token(s.seq))
                if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                    sched.finish(s.seq, "length")
        kv.check_integrity()
        for seq in (s for q in sched.waiting.values() for s in q):
            assert kv.block_table(seq.request_id) == []  # a waiting sequence pins no device memory
        if not arrivals and not sched.has_unfinished():
            break
    else:
        raise AssertionError("the scheduler stopped making progress")
    assert kv.pool.num_used == 0 and (kv.host is None or kv.host.num_used == 0)
    event(f"swapped out: {min(sched.preemptions_by_kind[PreemptKind.SWAP], 3)}+")
    event(f"recomputed: {min(sched.preemptions_by_kind[PreemptKind.RECOMPUTE], 3)}+")
    event(f"forks: {min(sched.num_forks, 3)}+, cow copies: {min(kv.num_cow_copies, 3)}+")
    for seq in live:
        if seq.finish_reason == "length":
            assert seq.output_token_ids == expected[seq.request_id], seq.request_id
        assert seq.status is Status.FINISHED
