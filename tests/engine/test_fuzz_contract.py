"""The sampling contract is complete: whatever values a request carries, `SamplingParams` and the
engine's model checks either refuse them with an InvalidRequest naming the field, or the engine serves
the request to its end without an error and with its state consistent after every step.

A hole in the contract shows up here as any other exception (OverflowError, TypeError, ...) or as an
accepted request that fails inside the step loop.
"""
from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from services.common.wire import InvalidRequest, SamplingParams
from tests.fuzzing import floats, fuzz_settings, ints, lists_of, number_like, texts, valid_unicode, wrong

FIELDS = set(SamplingParams.__dataclass_fields__) | {"prompt"}


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model):
    from tests.engine.conftest import make_engine

    return make_engine(tiny_model, max_seqs=8)


def _sampling_kwargs(adversarial: bool):
    """Every field's valid range with its edges (seeds over all 64 bits, temperatures down to denormals,
    top_k up to the vocabulary, odd but valid Unicode stops); with `adversarial`, out-of-range values and
    wrong types too."""
    def field(valid):
        return number_like(valid) if adversarial else valid

    return st.fixed_dictionaries({}, optional={
        "max_tokens": field(st.integers(1, 24)),
        "temperature": field(st.one_of(st.floats(0, 2), st.sampled_from([0.0, 5e-324, 1e-8, 1e-5, 100.0]))),
        "top_p": field(st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([5e-324, 1e-40, 1.0]))),
        "top_k": field(st.one_of(st.integers(-1, 8), st.sampled_from([511, 512]))),
        "seed": field(st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([2**63, 2**64 - 1, -(2**63)]))),
        "min_tokens": field(st.integers(0, 4)),
        "stop": (st.one_of(lists_of(texts, 10), st.lists(ints, max_size=3)) if adversarial else
                 st.lists(st.text(min_size=1, max_size=6).filter(valid_unicode), max_size=8)).map(_tuple),
        "stop_token_ids": (st.one_of(lists_of(st.integers(-2, 600)), lists_of(ints)) if adversarial else
                           st.lists(st.integers(0, 511), max_size=64)).map(_tuple),
        "ignore_eos": st.one_of(st.booleans(), wrong, ints) if adversarial else st.booleans(),
        "logprobs": st.one_of(st.none(), field(st.integers(0, 20))),
        "skip_special_tokens": st.one_of(st.booleans(), wrong) if adversarial else st.booleans(),
    })


def _tuple(v):
    return tuple(v) if isinstance(v, list) else v


prompts = st.one_of(st.lists(st.integers(0, 511), min_size=1, max_size=40),
                    st.lists(st.sampled_from([0, 1, 2, 510, 511]), min_size=1, max_size=5))


@given(kw=st.one_of(_sampling_kwargs(False), _sampling_kwargs(True)), prompt=prompts, batch_mates=st.integers(0, 2))
@fuzz_settings(200)  # each example runs an engine to completion; `make fuzz` runs 20x as many, freshly seeded
def test_every_accepted_request_is_served_and_every_refusal_names_its_field(fuzz_engine, kw, prompt, batch_mates):
    engine = fuzz_engine
    try:
        params = SamplingParams(**kw)
        engine.validate(prompt, params)
    except InvalidRequest as exc:
        event(f"refused: {exc.param}")
        assert exc.param and exc.param.split(".")[0].split("[")[0] in FIELDS | {"messages", "top_logprobs"}, exc.param
        assert exc.message and exc.status == 400
        return
    event("served")
    rid = f"fuzz-{abs(hash((repr(kw), tuple(prompt))))}"
    engine.add_request(rid, prompt, params)
    for i in range(batch_mates):  # ordinary requests beside it must be unaffected
        engine.add_request(f"{rid}-mate{i}", [5, 6, 7 + i], SamplingParams(max_tokens=4, temperature=0))
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, f"accepted request failed in the engine: {out.error!r} ({kw})"
            if out.request_id == rid:
                produced += len(out.new_token_ids)
                if out.finished:
                    assert out.finish_reason in ("stop", "length")
        engine.check_integrity()
    assert 1 <= produced <= params.max_tokens


@given(values=st.one_of(ints, floats, wrong))
@fuzz_settings(200)
def test_no_field_raises_anything_but_invalid_request(values):
    for name in SamplingParams.__dataclass_fields__:
        try:
            SamplingParams(**{name: values})
        except InvalidRequest as exc:
            assert exc.param in FIELDS | {"top_logprobs"}
