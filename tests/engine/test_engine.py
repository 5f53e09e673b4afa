"""Engine mechanics on a tiny random model: no KV leaks on any exit path, seeds, prefix salts, stops."""
from __future__ import annotations

import pytest

from services.engine.sequence import InvalidRequest, SamplingParams
from tests.engine.conftest import make_engine, run_all


def _prompt(n: int, start: int = 5) -> list[int]:
    return [(start + 7 * i) % 200 + 3 for i in range(n)]


def greedy(n=8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_completion_frees_every_block(tiny_model):
    engine = make_engine(tiny_model, block_size=4)
    out = run_all(engine, [{"id": f"r{i}", "prompt": _prompt(5 + i), "params": greedy(6)} for i in range(6)])
    assert all(len(v) == 6 for v in out.values())
    assert engine.kv.pool.num_used == 0


def _step_until(engine, cond, limit=200):
    for _ in range(limit):
        if cond():
            return
        engine.step()
        engine.check_integrity()
    raise AssertionError("condition never reached")


def test_abort_mid_prefill_frees_blocks_at_once(tiny_model):
    engine = make_engine(tiny_model, block_size=4, budget=8)
    seq = engine.add_request("long", _prompt(60), greedy(4))
    engine.add_request("other", _prompt(5, 50), greedy(30))
    _step_until(engine, lambda: 0 < seq.num_computed_tokens < 60)
    used = engine.kv.pool.num_used
    assert engine.abort_request("long")
    assert engine.kv.pool.num_used < used and not engine.kv.block_table("long")
    engine.check_integrity()
    run_all(engine, [])
    assert engine.kv.pool.num_used == 0


def test_abort_mid_decode_frees_blocks_at_once(tiny_model):
    engine = make_engine(tiny_model, block_size=4)
    seq = engine.add_request("d", _prompt(9), greedy(50))
    _step_until(engine, lambda: seq.num_output_tokens >= 5)
    assert engine.abort_request("d")
    assert not engine.abort_request("d")  # already gone
    engine.check_integrity()
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()


def test_abort_while_waiting(tiny_model):
    engine = make_engine(tiny_model, max_seqs=1)
    engine.add_request("a", _prompt(5), greedy(20))
    engine.add_request("b", _prompt(5, 9), greedy(20))
    engine.step()
    assert engine.scheduler.num_waiting == 1
    assert engine.abort_request("b")
    engine.check_integrity()


def test_same_seed_same_sample_alone_or_in_a_batch_of_16(tiny_model):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True)
    alone = run_all(make_engine(tiny_model), [{"id": "x", "prompt": _prompt(11), "params": params}])["x"]
    mates = [{"id": f"m{i}", "prompt": _prompt(3 + i, i), "params": SamplingParams(max_tokens=5 + i, temperature=1.0, seed=i, ignore_eos=True)} for i in range(15)]
    batch = run_all(make_engine(tiny_model), mates[:7] + [{"id": "x", "prompt": _prompt(11), "params": params}] + mates[7:])
    assert batch["x"] == alone
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=99, ignore_eos=True)
    assert run_all(make_engine(tiny_model), [{"id": "y", "prompt": _prompt(11), "params": other_seed}])["y"] != alone


def test_prefix_cache_counters_same_salt_hits_other_salt_zero(tiny_model):
    engine = make_engine(tiny_model, block_size=4)
    prompt = _prompt(30)
    run_all(engine, [{"id": "a", "prompt": prompt, "params": greedy(2), "salt": "tenant-1"}])
    same = engine.add_request("b", prompt, greedy(2), cache_salt="tenant-1")
    other = engine.add_request("c", prompt, greedy(2), cache_salt="tenant-2")
    run_all(engine, [])
    assert same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0


def test_preempted_sampling_continues_identically(tiny_model):
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in range(6)]
    reqs = [{"id": f"s{i}", "prompt": _prompt(10 + i, i), "params": p} for i, p in enumerate(params)]
    roomy = run_all(make_engine(tiny_model, block_size=4), reqs)
    tight_engine = make_engine(tiny_model, block_size=4, num_blocks=20)
    tight = run_all(tight_engine, reqs)
    assert tight_engine.scheduler.num_preemptions > 0
    assert tight == roomy


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_model):
    engine = make_engine(tiny_model)
    free = run_all(engine, [{"id": "f", "prompt": _prompt(7), "params": greedy(10)}])["f"]
    stop_at = free[3]
    first = free.index(stop_at)
    out = run_all(engine, [{"id": "s", "prompt": _prompt(7), "params": greedy(10, stop_token_ids=(stop_at,))}])["s"]
    assert out == free[: first + 1]
    mt = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(free[0],), min_tokens=3)
    out = run_all(engine, [{"id": "m", "prompt": _prompt(7), "params": mt}])["m"]
    assert free[0] not in out[:3] and len(out) >= 3


def test_stop_string_truncates_text_across_tokens(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request("t", _prompt(7), greedy(12))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.new_text for o in engine.step())
    assert len(text) >= 4
    stop = text[2:4]
    engine.add_request("u", _prompt(7), greedy(12, stop=(stop,)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert "".join(o.new_text for o in outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop"


def test_logprobs_are_returned_per_token(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request("l", _prompt(6), greedy(3, logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    for o in outs:
        (lp,) = o.logprobs
        assert lp.token_id == o.new_token_ids[0] and lp.logprob <= 0
        assert len(lp.top) == 2 and lp.top[0][0] == lp.token_id  # greedy picks the top token


@pytest.mark.parametrize("prompt_len,max_tokens,param", [(300, 4, "messages"), (200, 100, "max_tokens")])
def test_requests_beyond_the_context_are_refused(tiny_model, prompt_len, max_tokens, param):
    engine = make_engine(tiny_model)  # tiny model context: 256
    with pytest.raises(InvalidRequest) as exc:
        engine.add_request("big", _prompt(prompt_len), greedy(max_tokens))
    assert exc.value.param == param and exc.value.code == "context_length_exceeded"
    assert not engine.has_unfinished()


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5)])
def test_bad_sampling_parameters_name_the_field(field, value):
    with pytest.raises(InvalidRequest) as exc:
        SamplingParams(**{field: value})
    assert exc.value.param == field
