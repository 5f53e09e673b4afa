"""Async scheduling (overlap.py) against the synchronous step loop: the same tokens on every scheduler path --
seeded sampling, stop token ids, chunked prefill, preemption by recompute and by swap, aborts and faults while a
step is in flight, grammar-constrained rows -- with the engine's state checked after every step. The HF oracle
runs on this path too (test_oracle.py, test_multi_lora.py)."""
from __future__ import annotations

import random

import pytest

from services.common.wire import RequestFailed, SamplingParams
from services.engine.overlap import PLACEHOLDER
from tests.engine.conftest import make_engine

POISON = 7  # the step_error failpoint raises for a sequence whose prompt holds it


def _requests(n: int, seed: int = 3, vocab: int = 500) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(5, 60))]
        prompt = [t if t != POISON else POISON + 1 for t in prompt]
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0, 0.8]), seed=i,
                                top_p=rng.choice([1.0, 0.9]), stop_token_ids=(rng.randrange(10, vocab),),
                                min_tokens=rng.choice([0, 2]))
        out.append((f"r{i}", prompt, params))
    return out


def _run(engine, requests, *, abort: dict[int, str] | None = None) -> tuple[dict[str, list[int]], dict[str, BaseException]]:
    """Step to completion, checking integrity after every step; `abort`: {step number: request id} aborted
    between steps (with async scheduling: while the next step is in flight)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    errors: dict[str, BaseException] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
        step += 1
        if abort and step in abort:
            engine.abort_request(abort[step])
    engine.check_integrity()
    for seq in engine._seqs.values():
        assert PLACEHOLDER not in seq.token_ids
    return tokens, errors


VARIANTS = {
    "one-batch": {},
    "chunked": {"block_size": 4, "budget": 7},
    "recompute": {"block_size": 4, "num_blocks": 60, "budget": 64, "preemption_mode": "recompute"},
    "swap": {"block_size": 4, "num_blocks": 60, "budget": 64, "preemption_mode": "swap", "swap_space_bytes": 64 * 2**20},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_async_scheduling_is_token_identical_to_the_synchronous_loop(tiny_model, variant):
    kw = VARIANTS[variant]
    requests = _requests(40)
    sync = make_engine(tiny_model, **kw)
    expected, errors = _run(sync, requests)
    assert not errors
    engine = make_engine(tiny_model, async_scheduling=True, **kw)
    tokens, errors = _run(engine, requests)
    assert not errors
    assert tokens == expected
    assert engine.overlap.times.forward > 0  # the forwards really ran on the worker
    if "preemption_mode" in kw:
        assert engine.scheduler.num_preemptions > 0 and sync.scheduler.num_preemptions > 0
    if variant == "swap":
        assert engine.metrics.swap_out_blocks._value.get() > 0
    if variant == "chunked":
        assert max(len(p) for _, p, _ in requests) > 7


def test_a_request_aborted_while_its_next_step_is_in_flight_gets_nothing_more(tiny_model):
    requests = [(rid, p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for rid, p, _ in _requests(6)]
    expected, _ = _run(make_engine(tiny_model), requests)
    engine = make_engine(tiny_model, async_scheduling=True)
    tokens, _ = _run(engine, requests, abort={5: "r2", 9: "r4"})
    assert 0 < len(tokens["r2"]) < 30 and 0 < len(tokens["r4"]) < 30
    assert tokens["r2"] == expected["r2"][: len(tokens["r2"])]
    assert {k: v for k, v in tokens.items() if k not in ("r2", "r4")} == {
        k: v for k, v in expected.items() if k not in ("r2", "r4")}
    assert engine.kv.pool.num_used == 0 or engine.config.cache.enable_prefix_caching


def test_a_forward_failure_in_flight_fails_only_its_request(tiny_model):
    clean = [(rid, p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for rid, p, _ in _requests(5)]
    expected, _ = _run(make_engine(tiny_model), clean)
    engine = make_engine(tiny_model, async_scheduling=True, failpoints=(("step_error", POISON),))
    engine.add_request("early", clean[0][1], clean[0][2])
    for _ in range(3):  # a batch decoding, one step in flight, when the poison arrives
        engine.step()
    bad = ("bad", [1, 2, POISON], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    tokens, errors = _run(engine, clean[1:] + [bad])
    assert set(errors) == {"bad"} and isinstance(errors["bad"], RequestFailed)
    assert {rid: tokens[rid] for rid, _, _ in clean[1:]} == {rid: expected[rid] for rid, _, _ in clean[1:]}


def test_a_value_no_tensor_can_hold_fails_its_request_not_the_step(tiny_model):
    """The sampling batch is built while the previous forward runs: a seed the int64 tensor cannot hold
    fails that request alone, as in the synchronous loop."""
    clean = [(rid, p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)) for rid, p, _ in _requests(3)]
    expected, _ = _run(make_engine(tiny_model), clean)
    engine = make_engine(tiny_model, async_scheduling=True)
    for rid, p, params in clean:
        engine.add_request(rid, p, params)
    engine.step()  # one step in flight
    seq = engine.add_request("bad", [5, 6, 8], SamplingParams(max_tokens=10, temperature=0.7))
    seq.seed = 2**70
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in clean}
    errors = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                tokens[out.request_id] += out.new_token_ids
        engine.check_integrity()
    assert set(errors) == {"bad"}
    assert tokens == expected


def test_constrained_rows_are_not_overlapped_and_stay_identical(tiny_model):
    from services.common.structured import GUIDE_JSON_SCHEMA, Guide

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    guide = Guide(GUIDE_JSON_SCHEMA, schema=schema).text
    requests = _requests(6)
    requests += [(f"g{i}", p, SamplingParams(max_tokens=16, temperature=0, guide=guide))
                 for i, (_, p, _) in enumerate(_requests(3, seed=9))]
    expected, errors = _run(make_engine(tiny_model), requests)
    assert not errors
    tokens, errors = _run(make_engine(tiny_model, async_scheduling=True), requests)
    assert not errors and tokens == expected
