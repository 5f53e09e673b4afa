"""The CPU SGMV path (rank-class stacks + class-batched apply) against a per-token, per-module oracle.

The oracle knows nothing of classes, entries, grids or segments: every token multiplies its own
adapter's A and B for each targeted module and adds the result at that module's output offset.
"""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.kernels import build_sgmv_meta
from services.engine.kernels.sgmv_cpu import SHORT_ROWS, GroupPlan, lora_apply_classed, plan_group
from services.engine.lora.cpu_slots import CpuSlotStacks, class_widths
from services.engine.lora.weights import LoraWeights
from tests.engine.kernels.lora_oracle import (
    DIMS,
    GROUPS,
    LAYERS,
    MAX_RANK,
    adapter_spec,
    group_input,
    make_adapter,
    oracle,
    slices,
)

def stacks(max_slots: int, dtype=torch.float32) -> CpuSlotStacks:
    return CpuSlotStacks(LAYERS, slices(), DIMS, max_rank=MAX_RANK, max_slots=max_slots, dtype=dtype)


def check_all(cs: CpuSlotStacks, token_slots: torch.Tensor, owners, seed=0, atol=1e-4):
    meta = build_sgmv_meta(token_slots)
    plans = cs.plan(meta)
    for layer in range(LAYERS):
        for group in GROUPS:
            x, y = group_input(group, len(token_slots), seed + layer)
            want = oracle(x, y, layer, group, token_slots, owners)
            cs.apply(layer, group, x, y, plans)
            torch.testing.assert_close(y, want, atol=atol, rtol=1e-4, msg=f"layer {layer} group {group}")


# -- the apply path ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(adapter_spec, min_size=1, max_size=6),
    counts=st.lists(st.integers(0, 9), min_size=7, max_size=7),
    shuffle=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_classed_apply_matches_the_per_token_oracle(specs, counts, shuffle, seed):
    rng = random.Random(seed)
    cs = stacks(max_slots=len(specs) + 1)
    owners = {}
    for slot, (targets, rank, per_layer) in enumerate(specs):
        ranks = {(layer, m): (rng.randint(1, rank) if per_layer else rank) for layer in range(LAYERS) for m in targets}
        owners[slot] = make_adapter(seed + slot, targets, ranks)
        cs.install(slot, owners[slot])
    # Token counts per slot (and base rows, slot -1): 0..9 rows, so segments are short, long or absent.
    token_slots = [s for s, c in zip([-1, *range(len(specs))], counts) for _ in range(c)]
    if not token_slots:
        token_slots = [-1]
    if shuffle:
        rng.shuffle(token_slots)  # rows of one slot no longer contiguous: the gather/scatter paths
    for slot in set(token_slots) - {-1}:
        cs.activate(slot)  # the engine activates a slot when a running sequence pins it
    cs.check_integrity()
    check_all(cs, torch.tensor(token_slots), owners, seed)


def test_long_and_short_segments_and_holes_in_one_step():
    cs = stacks(max_slots=6)
    owners = {s: make_adapter(s, ["q_proj", "v_proj", "down_proj"], {(l, m): 2 + s for l in range(LAYERS) for m in ("q_proj", "v_proj", "down_proj")})
              for s in range(5)}
    for s, w in owners.items():
        cs.install(s, w)
        cs.activate(s)
    # slot 1 runs nothing this step (a hole in the grid); slot 3 has a long segment.
    token_slots = torch.tensor([-1, 0, 2, 2, 3, 3, 3, 3, 3, 3, 4, -1])
    plan = cs.plan(build_sgmv_meta(token_slots))["qkv"]
    assert plan.long and plan.batches and plan.pads is not None
    assert all(s.end - s.start > SHORT_ROWS for s in plan.long)
    check_all(cs, token_slots, owners)


def test_swaps_on_activation_keep_every_adapter_its_own_weights():
    cs = stacks(max_slots=5)
    owners = {s: make_adapter(10 + s, sorted(DIMS), {(l, m): 3 for l in range(LAYERS) for m in DIMS}) for s in range(5)}
    for s, w in owners.items():
        cs.install(s, w)
    for s in (4, 2, 0):
        cs.activate(s)
    cs.check_integrity()
    check_all(cs, torch.tensor([0, 2, 2, 4]), owners)
    cs.deactivate(2)
    cs.activate(3)
    cs.deactivate(4)
    cs.activate(1)
    cs.check_integrity()
    check_all(cs, torch.tensor([3, 0, 1, 1, -1]), owners)
    # The active prefix holds exactly the active slots: a step's grid never spans idle entries.
    for pools in cs.pools.values():
        for pool in pools:
            assert all(pool.owner[e] in (0, 1, 3) for e in range(pool.active))


def test_reinstall_and_evict_free_entries_for_others():
    cs = stacks(max_slots=2)
    a = make_adapter(1, ["q_proj"], {(l, "q_proj"): 8 for l in range(LAYERS)})
    b = make_adapter(2, ["o_proj", "up_proj"], {(l, m): 1 for l in range(LAYERS) for m in ("o_proj", "up_proj")})
    cs.install(0, a)
    cs.install(1, a)
    cs.install(0, b)  # slot 0 now holds b: a's qkv entry is freed, b takes o and gate_up entries
    cs.check_integrity()
    for s in (0, 1):
        cs.activate(s)
    check_all(cs, torch.tensor([0, 1, 0, 1]), {0: b, 1: a})
    cs.deactivate(0)
    cs.evict(0)
    cs.check_integrity()
    assert all(0 not in pool.owner for pools in cs.pools.values() for pool in pools)


def test_pools_grow_with_installed_adapters_only():
    cs = stacks(max_slots=16)
    assert cs.nbytes == 0  # nothing allocated before the first adapter
    w = make_adapter(3, ["q_proj"], {(l, "q_proj"): 4 for l in range(LAYERS)})
    for s in range(9):
        cs.install(s, w)
    # Rank 4 on q only packs into qkv's narrowest class (width 4): 4 -> 8 -> 16 entries, nothing else.
    assert [(p.width, p.capacity) for p in cs.pools["qkv"]] == [(4, 16), (8, 0), (16, 0), (24, 0)]
    assert cs.nbytes > 0 and cs.pools["o"][0].capacity == 0


def test_steps_after_a_pool_grows_read_the_grown_stacks():
    """apply caches each layer's views of the stacks; growing a pool replaces its tensors, so a step
    after the growth must not read the old ones (it would miss the new adapters' weights)."""
    cs = stacks(max_slots=12)
    owners = {s: make_adapter(40 + s, ["q_proj", "up_proj"], {(l, m): 2 for l in range(LAYERS) for m in ("q_proj", "up_proj")})
              for s in range(10)}
    cs.install(0, owners[0])
    cs.activate(0)
    check_all(cs, torch.tensor([0, -1, 0]), {0: owners[0]})  # caches views of 4-entry pools
    before = [p.capacity for p in cs.pools["qkv"]]
    for s in range(1, 10):
        cs.install(s, owners[s])
        cs.activate(s)
    assert [p.capacity for p in cs.pools["qkv"]] != before  # the pools grew
    check_all(cs, torch.tensor([0, 3, 3, 5, 9, 9, -1, 7, 1, 1, 1, 1, 1, 1]), owners, seed=3)


def test_class_widths_double_up_to_the_largest_packed_rank():
    assert class_widths(192) == (4, 8, 16, 32, 64, 128, 192)
    assert class_widths(24) == (4, 8, 16, 24)
    assert class_widths(8) == (4, 8)
    assert class_widths(3) == (3,)


def test_bf16_stacks_follow_the_oracle_within_bf16_rounding():
    cs = stacks(max_slots=3, dtype=torch.bfloat16)
    owners = {s: make_adapter(20 + s, sorted(DIMS), {(l, m): 4 for l in range(LAYERS) for m in DIMS}) for s in range(3)}
    for s, w in owners.items():
        cs.install(s, LoraWeights(w.content_id, w.name, w.max_rank,
                                  {k: (a.bfloat16(), b.bfloat16()) for k, (a, b) in w.tensors.items()}))
        cs.activate(s)
    token_slots = torch.tensor([0, 1, 1, 2, 2, 2, 2, 2, 2, -1])
    plans = cs.plan(build_sgmv_meta(token_slots))
    x, y = group_input("qkv", len(token_slots), 5)
    want = oracle(x, y, 0, "qkv", token_slots, owners)
    got = y.bfloat16()
    cs.apply(0, "qkv", x.bfloat16(), got, plans)
    torch.testing.assert_close(got.float(), want, atol=0.15, rtol=0.05)


# -- host wrapper checks ----------------------------------------------------------------------------


def test_apply_refuses_operands_that_do_not_fit_the_plan():
    cs = stacks(max_slots=2)
    cs.install(0, make_adapter(4, ["q_proj"], {(l, "q_proj"): 2 for l in range(LAYERS)}))
    cs.activate(0)
    plans = cs.plan(build_sgmv_meta(torch.tensor([0, 0])))
    plan = plans["qkv"]
    x, y = group_input("qkv", 2, 0)
    with pytest.raises(ValueError, match="rows"):
        cs.apply(0, "qkv", x[:1], y[:1], plans)
    with pytest.raises(ValueError, match="dtype"):
        cs.apply(0, "qkv", x.double(), y, plans)
    with pytest.raises(ValueError, match="row-major"):
        cs.apply(0, "qkv", x, y.t().contiguous().t(), plans)
    with pytest.raises(ValueError, match="do not fit"):
        lora_apply_classed(x, y[:, :8], [p.a[0] if p.a is not None else None for p in cs.pools["qkv"]],
                           [p.b[0] if p.b is not None else None for p in cs.pools["qkv"]], [[2]] * 2, plan)


def test_a_step_without_adapter_rows_plans_nothing():
    cs = stacks(max_slots=2)
    plan = cs.plan(build_sgmv_meta(torch.tensor([-1, -1, -1])))
    assert all(isinstance(p, GroupPlan) and p.is_empty for p in plan.values())
    with pytest.raises(ValueError, match="short_rows"):
        plan_group(build_sgmv_meta(torch.tensor([0])), lambda s: (0, 0), short_rows=0)
