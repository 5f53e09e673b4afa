"""A request can only fail itself: an error while serving one request ends that request only, the
others in its step finish exactly as they would have, and the engine's state stays consistent.

Faults are real: failpoints (EngineConfig.failpoints) make the forward raise for a sequence holding a
given token, and a request built around validation carries a value the engine's tensors cannot hold.
"""
from __future__ import annotations

import asyncio

import torch

import pytest

from services.common.wire import RequestFailed, SamplingParams
from services.engine.async_engine import AsyncEngine

POISON = 7  # a token id: the step_error failpoint raises for any sequence whose prompt holds it


def _prompts(n: int, length: int = 12) -> list[list[int]]:
    return [[(31 * i + 7 * j + 100) % 500 + 10 for j in range(length + i)] for i in range(n)]


def _run(engine, requests) -> tuple[dict[str, list[int]], dict[str, BaseException]]:
    """Step to completion, checking integrity every step; tokens per request and errors per request."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    errors: dict[str, BaseException] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
                assert out.finished and out.finish_reason == "error"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    engine.check_integrity()
    assert engine.kv.pool.num_used == 0 or engine.config.cache.enable_prefix_caching
    return tokens, errors


def _greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("cpu_attention", ["native", "torch"])
def test_a_forward_failure_fails_only_its_request_and_the_others_are_token_identical(tiny_model, cpu_attention):
    clean = [(f"r{i}", p, _greedy()) for i, p in enumerate(_prompts(5))]
    expected, errors = _run(_engine_with(tiny_model, cpu_attention), clean)
    assert not errors

    engine = _engine_with(tiny_model, cpu_attention, failpoints=(("step_error", POISON),))
    poisoned = [("bad", [POISON, 11, 12, 13], _greedy())]
    tokens, errors = _run(engine, clean[:2] + poisoned + clean[2:])
    assert set(errors) == {"bad"} and isinstance(errors["bad"], RequestFailed)
    assert errors["bad"].status == 500 and errors["bad"].code == "request_failed"
    assert tokens["bad"] == []
    assert {rid: tokens[rid] for rid, _, _ in clean} == expected
    assert _failures(engine, "step") == 1


def test_a_poison_request_arriving_mid_generation_leaves_running_requests_untouched(tiny_model):
    expected, _ = _run(_engine_with(tiny_model), [(f"r{i}", p, _greedy(16)) for i, p in enumerate(_prompts(3))])
    engine = _engine_with(tiny_model, failpoints=(("step_error", POISON),))
    for i, p in enumerate(_prompts(3)):
        engine.add_request(f"r{i}", p, _greedy(16))
    tokens = {f"r{i}": [] for i in range(3)}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.add_request("bad", [1, 2, POISON], _greedy(16))  # joins a batch that is decoding
    failed = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                failed.append(out.request_id)
            else:
                tokens[out.request_id] += out.new_token_ids
        engine.check_integrity()
    assert failed == ["bad"]
    assert tokens == expected


def test_a_failure_handling_one_output_fails_only_that_request(tiny_model):
    engine = _engine_with(tiny_model)
    expected, _ = _run(_engine_with(tiny_model), [(f"r{i}", p, _greedy()) for i, p in enumerate(_prompts(3))])
    bad = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=("x",))
    object.__setattr__(bad, "stop", (b"not text",))  # past validation: the stop matcher cannot compare it
    tokens, errors = _run(engine, [(f"r{i}", p, _greedy()) for i, p in enumerate(_prompts(3))] + [("bad", [5, 6, 8], bad)])
    assert set(errors) == {"bad"}
    assert {k: v for k, v in tokens.items() if k != "bad"} == expected
    assert _failures(engine, "postprocess") == 1


def test_values_no_tensor_can_hold_fail_their_request_not_the_step(tiny_model):
    """What the 2^63 seed did before it was refused at the contract: now, were one to slip past it, only
    its request would fail (sampling tensors are built per step, so the step is re-run per sequence)."""
    engine = _engine_with(tiny_model)
    expected, _ = _run(_engine_with(tiny_model), [(f"r{i}", p, _greedy()) for i, p in enumerate(_prompts(3))])
    bad = SamplingParams(max_tokens=10, temperature=0.7)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(_prompts(3)):
        engine.add_request(f"r{i}", p, _greedy())
        tokens[f"r{i}"] = []
    seq = engine.add_request("bad", [5, 6, 8], bad)
    seq.seed = 2**70  # int64 seeds tensor overflows
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


def test_an_error_outside_any_request_fails_the_running_ones_and_the_loop_goes_on(tiny_model, monkeypatch):
    """Fault injection into the scheduler (an error no request can be blamed for): the running requests
    get a clean error, waiting ones are served afterwards, state is checked, the loop stays alive."""
    engine = _engine_with(tiny_model, max_seqs=2)

    async def main():
        a = AsyncEngine(engine)
        a.start(asyncio.get_running_loop())
        try:
            real = engine.scheduler.schedule
            calls = {"n": 0}

            def flaky():
                calls["n"] += 1
                if calls["n"] == 3:  # mid-generation of the first two requests
                    raise RuntimeError("injected scheduler fault")
                return real()

            monkeypatch.setattr(engine.scheduler, "schedule", flaky)

            async def one(rid: str, prompt: list[int]):
                out = []
                try:
                    async for o in a.generate(rid, prompt, _greedy(8)):
                        out += o.new_token_ids
                except RequestFailed as exc:
                    return rid, exc
                return rid, out

            results = dict(await asyncio.gather(*(one(f"r{i}", p) for i, p in enumerate(_prompts(4)))))
            failed = {rid for rid, r in results.items() if isinstance(r, RequestFailed)}
            assert failed == {"r0", "r1"}  # the two running when the fault hit; r2, r3 were waiting
            assert all(len(results[r]) == 8 for r in ("r2", "r3"))
            assert a.alive
            after = [t async for o in a.generate("later", _prompts(1)[0], _greedy(4)) for t in o.new_token_ids]
            assert len(after) == 4
        finally:
            a.shutdown()

    asyncio.run(main())
    engine.check_integrity()
    assert _failures(engine, "unattributed") == 2


def test_inconsistent_state_after_an_error_stops_the_loop_and_reports_its_death(tiny_model, monkeypatch):
    engine = _engine_with(tiny_model)
    died = []

    async def main():
        a = AsyncEngine(engine, on_death=lambda: died.append(True))
        a.start(asyncio.get_running_loop())

        def broken():
            raise RuntimeError("injected")

        def corrupt_check():
            raise AssertionError("injected: KV blocks leaked")

        monkeypatch.setattr(engine.scheduler, "schedule", broken)
        monkeypatch.setattr(engine, "check_integrity", corrupt_check)
        with pytest.raises(Exception) as exc:
            async for _ in a.generate("r", _prompts(1)[0], _greedy(4)):
                pass
        assert exc.value.__class__.__name__ in ("RequestFailed", "EngineDead")
        for _ in range(50):
            if not a.alive:
                break
            await asyncio.sleep(0.02)
        assert not a.alive
        a.shutdown()

    asyncio.run(main())
    assert died == [True]


def _engine_with(model, cpu_attention: str = "auto", failpoints=(), max_seqs: int = 256):
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model_dir=model, cache=CacheConfig(block_size=16, memory_bytes=64 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048),
        lora=LoraConfig(), cpu_attention=cpu_attention, failpoints=failpoints,
    ))


def _failures(engine, where: str) -> float:
    return engine.metrics.request_failures.labels(model=engine.config.model_name, where=where)._value.get()


def test_a_grammar_failure_fails_only_its_constrained_request(tiny_model):
    """A matcher in a state the grammar engine cannot go on from (here: already terminated) fails its own
    request -- whether the mask fill or the token's acceptance is what raises -- and the free and the other
    constrained requests of the same steps finish exactly as they would have."""
    from services.common.structured import GUIDE_JSON_OBJECT, Guide

    guided = SamplingParams(max_tokens=10, temperature=0, guide=Guide(GUIDE_JSON_OBJECT).text)
    clean = [(f"r{i}", p, _greedy()) for i, p in enumerate(_prompts(3))] + [("g", _prompts(4)[3], guided)]
    expected, errors = _run(_engine_with(tiny_model), clean)
    assert not errors
    engine = _engine_with(tiny_model)
    for rid, prompt, params in clean:
        engine.add_request(rid, prompt, params)
    seq = engine.add_request("bad", [5, 6, 8], guided)
    assert seq.matcher.raw.accept_string("{}") and seq.matcher.accept(engine.eos_token_ids[0])
    assert seq.matcher.is_terminated
    tokens, errors = _run(engine, [])
    assert set(errors) == {"bad"} and isinstance(errors["bad"], RequestFailed)
    assert {rid: tokens[rid] for rid, _, _ in clean} == expected


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_an_adapter_whose_activations_overflow_leaves_no_trace_in_reused_kv_blocks(demo_kit, tmp_path, kv_dtype):
    """An adapter whose weights overflow the hidden state writes NaN/Inf K/V. Freed, those blocks go to the next
    requests, whose prefill gathers whole blocks: slots past their fill are masked out, but a masked NaN still
    poisons the softmax (NaN + -inf) and the weighted sum (0 * NaN). Found by the quality gate: a demo adapter
    judged after such an upload got one degenerate token. The cache must only ever hold finite values, so the
    next requests -- another tenant's -- are token- and logprob-identical to a fresh engine's."""
    import math

    from safetensors.torch import load_file, save_file

    from services.common.lora_format import content_id
    from services.engine.sequence import AdapterRef
    from services.modelkit import make_random_adapter
    from tests.engine.conftest import make_engine

    path = make_random_adapter(demo_kit.base_dir, tmp_path / "overflow", rank=4, seed=1,
                               target_modules=("q_proj", "down_proj"), layers=[1])
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: torch.full_like(v, 1e18) if "down_proj" in k else v for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    overflow = AdapterRef(name="overflow", path=str(path), content_id=content_id(path))
    # Few blocks, so the healthy requests get blocks the overflowing ones used; prompts of 13-20 tokens leave
    # stale slots in their last block.
    kw = dict(num_blocks=40, prefix_caching=False, kv_dtype=kv_dtype, inline_loads=True)
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
    healthy = [(f"h{i}", p, greedy) for i, p in enumerate(_prompts(8, 13))]

    def run(engine, adapter=None, reqs=healthy):
        for rid, prompt, params in reqs:
            engine.add_request(rid, prompt, params, adapter=adapter)
        out: dict[str, list] = {rid: [] for rid, _, _ in reqs}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += [(t, lp.logprob) for t, lp in zip(o.new_token_ids, o.logprobs)]
        return out

    fresh = run(make_engine(demo_kit.base_dir, **kw))
    engine = make_engine(demo_kit.base_dir, **kw)
    poisoned = run(engine, overflow, [(f"x{i}", p, SamplingParams(max_tokens=30, temperature=0, logprobs=1))
                                      for i, p in enumerate(_prompts(8, 40))])
    assert all(not math.isfinite(lp) or lp < -7 for o in poisoned.values() for _, lp in o)  # it did overflow
    finite = all(torch.isfinite(t.float()).all() for layer in engine.runner.kv_caches for t in layer.tensors())
    assert run(engine) == fresh
    assert finite
