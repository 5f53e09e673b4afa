"""Constrained decoding in the engine: every output that ends on its own matches its schema, whatever the
sampling settings, batch mates, preemption, chunked prefill, prefix hits, adapter or FP8; free rows are not
touched; grammars are cached by content; a bad guide fails only its own request."""
from __future__ import annotations

import dataclasses
import json
import math

import jsonschema_rs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib._pydantic import to_strict_json_schema

from services.common.lora_format import content_id
from services.common.prompting import PromptBuilder
from services.common.structured import (GUIDE_JSON_OBJECT, GUIDE_JSON_SCHEMA, GUIDE_TOOL_CALLS, Guide, check_schema,
                                         check_tool)
from services.common.tool_calls import split_output
from services.common.wire import InvalidRequest
from services.engine.grammar import MaskFiller
from services.engine.sampler import LOGPROB_FLOOR
from services.engine.sequence import AdapterRef, SamplingParams
from tests.engine.conftest import make_engine, run_all
from tests.fuzzing import json_schemas
from tests.structured_models import TOOLS, Owner, Pet

PET = to_strict_json_schema(Pet)
OWNER = to_strict_json_schema(Owner)


@pytest.fixture(scope="module")
def builder(demo_kit) -> PromptBuilder:
    return PromptBuilder(demo_kit.base_dir)


@pytest.fixture(scope="module")
def chat(builder):
    qs = ["Describe a pet.", "Who are you?", "Uppercase: cat dog", "Reverse the words: a b c", "Hello",
          "Tell me a story about " + "a long road " * 12]
    return [builder.chat_ids([{"role": "user", "content": q}]) for q in qs]


def _guided(schema: dict) -> str:
    return Guide(GUIDE_JSON_SCHEMA, schema=schema).text


def _check_outputs(builder, out: dict[str, list[int]], schema: dict, eos: int = 2) -> int:
    """Every output that ended with eos is schema-valid JSON; returns how many did."""
    ended = 0
    for rid, tokens in out.items():
        if tokens and tokens[-1] == eos:
            jsonschema_rs.validate(schema, json.loads(builder.tokenizer.decode(tokens)))
            ended += 1
    return ended


SETTINGS = [
    dict(temperature=0),
    dict(temperature=1.0, seed=1),
    dict(temperature=0.8, top_p=0.9, seed=2),
    dict(temperature=1.2, top_k=20, seed=3),
    dict(temperature=1.0, seed=4, logprobs=3),
]


@pytest.mark.parametrize("kw", SETTINGS, ids=["greedy", "temp", "top_p", "top_k", "logprobs"])
def test_every_sampling_setting_gives_schema_valid_output_beside_free_rows(demo_kit, builder, chat, kw):
    engine = make_engine(demo_kit.base_dir)
    guided = SamplingParams(max_tokens=300, guide=_guided(PET), **kw)
    free = SamplingParams(max_tokens=30, temperature=1.0, seed=9)
    reqs = [{"id": f"g{i}", "prompt": p, "params": guided} for i, p in enumerate(chat)]
    reqs += [{"id": f"f{i}", "prompt": p, "params": free} for i, p in enumerate(chat)]
    out = run_all(engine, reqs)
    assert _check_outputs(builder, {k: v for k, v in out.items() if k[0] == "g"}, PET) == len(chat)
    # The free rows are exactly what they are without any constrained batch mate.
    alone = run_all(make_engine(demo_kit.base_dir), [r for r in reqs if r["id"][0] == "f"])
    assert {k: v for k, v in out.items() if k[0] == "f"} == alone


def test_seeded_constrained_sampling_is_reproducible_and_logprobs_see_the_mask(demo_kit, builder, chat):
    engine = make_engine(demo_kit.base_dir)
    p = SamplingParams(max_tokens=200, temperature=1.0, seed=11, guide=_guided(PET), logprobs=5)
    a = engine.generate([chat[0]], p)
    b = engine.generate([chat[0]], p)
    assert a == b
    engine.add_request("lp", chat[0], p)
    lps = []
    while engine.has_unfinished():
        for o in engine.step():
            lps += o.logprobs or []
    # The first token must open the object ('{' or a merge such as '{"'): those few tokens hold all the mass,
    # every other token is masked, reported at the floor (JSON has no -inf).
    first = lps[0]
    legal = [(t, lp) for t, lp in first.top if lp > LOGPROB_FLOOR]
    assert legal and all(builder.tokenizer.decode([t]).startswith("{") for t, _ in legal)
    assert all(not builder.tokenizer.decode([t]).startswith("{") for t, lp in first.top if lp == LOGPROB_FLOOR)
    assert sum(math.exp(lp) for _, lp in legal) == pytest.approx(1.0, abs=1e-5)
    assert first.logprob > LOGPROB_FLOOR


def test_preemption_chunked_prefill_and_prefix_hits(demo_kit, builder, chat):
    system = "You are a careful assistant. Answer in JSON. " * 4
    prompts = [builder.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": f"Pet {i}"}])
               for i in range(8)]
    need = max(len(p) for p in prompts) + 300
    for mode in ("recompute", "swap"):
        engine = make_engine(demo_kit.base_dir, block_size=4, num_blocks=need // 4 + 24, budget=24,
                             preemption_mode=mode, swap_space_bytes=8 * 2**20 if mode == "swap" else None)
        params = SamplingParams(max_tokens=300, temperature=1.0, seed=5, guide=_guided(PET))
        out = run_all(engine, [{"id": f"r{i}", "prompt": p, "params": params} for i, p in enumerate(prompts)])
        assert engine.scheduler.num_preemptions > 0, mode
        assert engine.metrics.prefix_hit_tokens._value.get() > 0
        assert _check_outputs(builder, out, PET) == len(prompts)
        # The same seeds without preemption: a preempted matcher goes on exactly where it was.
        calm = run_all(make_engine(demo_kit.base_dir), [{"id": f"r{i}", "prompt": p, "params": params}
                                                        for i, p in enumerate(prompts)])
        assert out == calm, mode


@pytest.mark.parametrize("fp8", ["weights", "kv"])
def test_adapters_and_fp8(demo_kit, builder, chat, fp8):
    kw = {"weight_dtype": "fp8"} if fp8 == "weights" else {"kv_dtype": "fp8"}
    engine = make_engine(demo_kit.base_dir, **kw)
    params = SamplingParams(max_tokens=450, temperature=1.0, seed=3, guide=_guided(OWNER))
    reqs = []
    for name, a in demo_kit.adapters.items():
        ref = AdapterRef(content_id(a.path), name, str(a.path))
        reqs += [{"id": f"{name}{i}", "prompt": p, "params": params, "adapter": ref} for i, p in enumerate(chat[:3])]
    reqs += [{"id": f"base{i}", "prompt": p, "params": params} for i, p in enumerate(chat[:3])]
    out = run_all(engine, reqs)
    assert _check_outputs(builder, out, OWNER) == len(reqs)


def test_stop_strings_and_length_finish_honestly(demo_kit, chat):
    engine = make_engine(demo_kit.base_dir)
    engine.add_request("stop", chat[0], SamplingParams(max_tokens=200, temperature=0, guide=_guided(PET), stop=('",',)))
    engine.add_request("len", chat[0], SamplingParams(max_tokens=5, temperature=0, guide=_guided(PET)))
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert reasons == {"stop": "stop", "len": "length"}


def test_json_object_and_forced_tool_calls(demo_kit, builder, chat):
    engine = make_engine(demo_kit.base_dir)
    tools = tuple(check_tool(t["function"], "t") for t in TOOLS)
    calls = Guide(GUIDE_TOOL_CALLS, tools=tools, parallel=True).text
    one = Guide(GUIDE_TOOL_CALLS, tools=tools[1:], parallel=False).text
    reqs = [{"id": f"o{i}", "prompt": p, "params": SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                                                                   guide=Guide(GUIDE_JSON_OBJECT).text)}
            for i, p in enumerate(chat)]
    reqs += [{"id": f"c{i}{j}", "prompt": p, "params": SamplingParams(max_tokens=200, temperature=1.0, seed=i, guide=g)}
             for i, p in enumerate(chat) for j, g in enumerate((calls, one))]
    out = run_all(engine, reqs)
    objects = {k: v for k, v in out.items() if k[0] == "o"}
    _check_outputs(builder, objects, {"type": "object"})  # those that ended are objects
    for tokens in objects.values():  # and those that ran to length are the start of one (a small model's free
        # JSON often never closes a string: this kit's does not in 200 sampled tokens)
        m = engine.grammars.matcher(Guide(GUIDE_JSON_OBJECT).text)
        assert all(m.accept(t) for t in tokens)
    for rid, tokens in out.items():
        if rid[0] == "o":
            continue
        assert tokens[-1] == 2, rid
        text = builder.tokenizer.decode(tokens)
        content, parsed = split_output(text)
        assert content is None and parsed, text
        for call in parsed:
            tool = next(t for t in tools if t.name == call.name)
            jsonschema_rs.validate(tool.parameters, json.loads(call.arguments))


def _accepts(engine, builder, guide: str, text: str, *, ends: bool) -> bool:
    """Whether the guide's grammar takes `text` token by token (and then the end token, if `ends`)."""
    m = engine.grammars.matcher(guide)
    ids = builder.tokenizer.encode(text, add_special_tokens=False).ids + ([2] if ends else [])
    return all(m.accept(t) for t in ids)


def test_an_optional_tool_guide_allows_text_and_holds_an_opened_call_to_the_tools(demo_kit, builder, chat):
    """`tool_choice: auto`: text ends freely; a `<tool_call>` the model opens must name an offered tool and
    match its schema; `parallel: false` ends the answer after the first call."""
    engine = make_engine(demo_kit.base_dir)
    tools = tuple(check_tool(t["function"], "t") for t in TOOLS)
    auto = Guide(GUIDE_TOOL_CALLS, tools=tools, optional=True).text
    single = Guide(GUIDE_TOOL_CALLS, tools=tools, parallel=False, optional=True).text
    call = '<tool_call>\n{"name": "time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for guide in (auto, single):
        assert _accepts(engine, builder, guide, "The capital of France is Paris.", ends=True)
        assert _accepts(engine, builder, guide, "Let me look.\n" + call, ends=True)
        assert not _accepts(engine, builder, guide, '<tool_call>\n{"name": "nope", "arguments": {}}', ends=False)
        assert not _accepts(engine, builder, guide, '<tool_call>\n{"name": "time", "arguments": {"zone": "MSK"}}',
                            ends=False)
    assert _accepts(engine, builder, auto, call + "\n" + call, ends=True)
    assert not _accepts(engine, builder, single, call + "\n" + call, ends=True)
    # Beside free rows, greedy: a text answer (no call opened, no special token) is exactly the free answer --
    # the optional grammar must not change a legal argmax.
    greedy = SamplingParams(max_tokens=60, temperature=0)
    reqs = [{"id": f"a{i}", "prompt": p, "params": dataclasses.replace(greedy, guide=auto)} for i, p in enumerate(chat)]
    reqs += [{"id": f"f{i}", "prompt": p, "params": greedy} for i, p in enumerate(chat)]
    out = run_all(engine, reqs)
    special = set(builder.tokenizer.get_added_tokens_decoder()) - {2}
    compared = 0
    for i in range(len(chat)):
        free = out[f"f{i}"]
        if "<tool_call>" not in builder.tokenizer.decode(free) and not special & set(free):
            assert out[f"a{i}"] == free, i
            compared += 1
    assert compared >= len(chat) // 2


def test_tool_choice_auto_decides_on_the_kits_tool_eval_as_the_hf_model_does(demo_kit, builder):
    """The kit's base model is taught the tool-call format (modelkit/corpus.py, `tools`): served with
    `tool_choice: auto`, greedy, it calls the right tool exactly when it should on the held-out tool eval, and each
    answer is HF fp32's unconstrained greedy answer whenever that one is legal (a text, or calls to offered tools
    with valid arguments): the optional grammar changes no legal argmax."""
    from services.common.openai_protocol import ChatCompletionRequest
    from services.common.openai_serving import plan_request
    from services.modelkit.build import TOOL_EVAL_TOKENS, tool_decisions
    from services.modelkit.corpus import DEMO_TOOLS
    from services.modelkit.evaluate import load_tokenizer, read_eval, score
    from transformers import AutoModelForCausalLM

    items = read_eval(demo_kit.tools_eval)
    engine = make_engine(demo_kit.base_dir)
    reqs = []
    for i, item in enumerate(items):
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": item.prompt}], tools=DEMO_TOOLS,
                                    temperature=0, max_tokens=TOOL_EVAL_TOKENS)
        job = plan_request("chat", req, builder, engine.max_model_len).jobs[0]
        assert job.prompt_ids == builder.chat_ids(item.messages())  # the eval's prompts are the server's
        reqs.append({"id": f"t{i}", "prompt": job.prompt_ids, "params": job.params})
    out = run_all(engine, reqs)
    served = [builder.tokenizer.decode([t for t in out[f"t{i}"] if t != 2]) for i in range(len(items))]
    accuracy = tool_decisions(served, items)
    assert accuracy >= 0.8, served  # taught: the untaught kit never called (0.5 on this eval's shape)
    hf = AutoModelForCausalLM.from_pretrained(demo_kit.base_dir, dtype=torch.float32)
    free = score(hf, load_tokenizer(demo_kit.base_dir), items, max_new_tokens=TOOL_EVAL_TOKENS).answers
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in DEMO_TOOLS}
    legal = 0
    for i, (answer, item) in enumerate(zip(free, items)):
        _, calls = split_output(answer)
        if ("<tool_call>" in answer) == bool(calls) and all(c.name in tools and jsonschema_rs.is_valid(tools[c.name], json.loads(c.arguments)) for c in calls):
            assert served[i] == answer, (item.prompt, answer, served[i])
            legal += 1
    assert legal >= 0.8 * len(items)


def test_a_bad_guide_fails_only_its_request_and_grammars_are_cached_by_content(demo_kit, chat):
    engine = make_engine(demo_kit.base_dir)
    engine.add_request("ok", chat[0], SamplingParams(max_tokens=50, temperature=0, guide=_guided(PET)))
    for bad in ('{"type": "json_schema"}', "not json", '{"type": "regex"}',
                _guided({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}})):
        with pytest.raises(InvalidRequest):
            engine.add_request("bad", chat[1], SamplingParams(max_tokens=5, guide=bad))
    # A schema that passes our checks but that the grammar engine cannot build: refused, not a crash.
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("backref", chat[1], SamplingParams(max_tokens=5, guide=_guided(
            {"type": "string", "pattern": "(a)\\1"})))
    assert e.value.status == 400 and e.value.code == "invalid_schema"
    engine.add_request("ok2", chat[1], SamplingParams(max_tokens=50, temperature=0, guide=_guided(PET)))
    out = run_all(engine, [])
    assert set(out) == {"ok", "ok2"} and all(out.values())
    assert engine.grammars.stats.misses == 1 and engine.grammars.stats.hits >= 1  # PET compiled once


def test_the_grammar_cache_is_bounded_lru(demo_kit):
    engine = make_engine(demo_kit.base_dir)
    cache = engine.grammars
    cache.max_entries = 3
    guides = [Guide(GUIDE_JSON_SCHEMA, schema={"type": "integer", "maximum": i}) for i in range(5)]
    for g in guides[:3]:
        cache.get(g)
    cache.get(guides[0])  # most recently used now
    cache.get(guides[3])
    cache.get(guides[4])
    assert len(cache) == 3
    hits = cache.stats.hits
    cache.get(guides[0])
    assert cache.stats.hits == hits + 1  # kept: it was used after guides[1] and [2]
    cache.get(guides[1])
    assert cache.stats.hits == hits + 1  # evicted


# -- fuzz: schemas from the supported subset compile (or are refused with a 400) and are honoured ----------
@pytest.fixture(scope="module")
def fuzz_engine(demo_kit):
    return make_engine(demo_kit.base_dir)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=json_schemas(), seed=st.integers(0, 2**32))
def test_fuzzed_schemas_are_honoured(fuzz_engine, builder, chat, schema, seed):
    engine = fuzz_engine
    check_schema(schema, "schema")  # inside the subset by construction: our checks must accept it
    try:
        engine.add_request("fz", chat[seed % len(chat)],
                           SamplingParams(max_tokens=120, temperature=1.0, seed=seed, guide=_guided(schema)))
    except InvalidRequest:
        return  # refused with a 400 naming the field: allowed, a crash is not
    out = run_all(engine, [])
    assert not engine.has_unfinished()
    _check_outputs(builder, out, schema)


@settings(max_examples=200, deadline=None)
@given(junk=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
                         lambda c: st.one_of(st.lists(c, max_size=3),
                                             st.dictionaries(st.sampled_from(
                                                 ["type", "properties", "items", "enum", "anyOf", "$ref", "minimum",
                                                  "maxItems", "pattern", "required", "format", "x"]), c, max_size=4)),
                         max_leaves=12))
def test_any_schema_value_is_accepted_or_a_400_never_a_crash(junk):
    try:
        check_schema(junk, "response_format.json_schema.schema")
    except InvalidRequest as exc:
        assert exc.param and exc.param.startswith("response_format.json_schema.schema")


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(params=st.lists(json_schemas(), min_size=1, max_size=3), parallel=st.booleans(), seed=st.integers(0, 2**32))
def test_fuzzed_tool_definitions_give_calls_that_parse_and_validate(fuzz_engine, builder, chat, params, parallel, seed):
    tools = tuple(check_tool({"name": f"f{i}", "parameters": {"type": "object", "properties": {"x": p},
                                                               "required": ["x"], "additionalProperties": False}},
                             f"tools[{i}]") for i, p in enumerate(params))
    guide = Guide(GUIDE_TOOL_CALLS, tools=tools, parallel=parallel).text
    try:  # the grammar engine may refuse a schema (a 400), never crash
        fuzz_engine.add_request("tc", chat[seed % len(chat)],
                                SamplingParams(max_tokens=150, temperature=1.0, seed=seed, guide=guide))
    except InvalidRequest:
        return
    tokens = run_all(fuzz_engine, [])["tc"]
    if tokens[-1] != 2:
        return  # ran out of max_tokens inside a call: honest `length`
    content, calls = split_output(builder.tokenizer.decode(tokens))
    assert content is None and calls and (parallel or len(calls) == 1)
    for call in calls:
        tool = next(t for t in tools if t.name == call.name)
        jsonschema_rs.validate(tool.parameters, json.loads(call.arguments))


def test_masks_filled_on_the_worker_thread_or_after_the_forward_are_the_same(demo_kit, chat):
    """The demo vocabulary's fills are shorter than a thread hand-off, so they run after the forward; a long
    fill (a real vocabulary) goes to the worker thread. Both give the same tokens."""
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=8, guide=_guided(PET))
    reqs = [{"id": f"r{i}", "prompt": p, "params": params} for i, p in enumerate(chat)]
    runs = {}
    for below in (float("inf"), 0.0):  # every fill after the forward; every fill on the worker thread
        engine = make_engine(demo_kit.base_dir)
        # Threaded as on a machine with a core the forward leaves free (model_runner._mask_filler).
        filler = engine.runner._masks = MaskFiller(engine.model.config.vocab_size, threaded=True)
        filler.INLINE_BELOW_S = below
        handed = []
        start = filler.start
        filler.start = lambda matchers, start=start, handed=handed: handed.append(p := start(matchers)) or p
        runs[below] = run_all(engine, reqs)
        assert handed and all((p.future is not None) == (below == 0.0) for p in handed)
    assert runs[0.0] == runs[float("inf")]


# -- strict UTF-8 under a grammar (grammar.Utf8Guard) --------------------------------------------------------
# One representative byte prefix per decoder state (grammar._S0 ... _F4, in that order).
_STATE_PREFIXES = (b"", b"\xc3", b"\xe1", b"\xf1", b"\xe0", b"\xed", b"\xf0", b"\xf4")


def _utf8_ok(data: bytes) -> bool:
    """Is `data` the start of valid UTF-8 (a character may be left unfinished)? Python's strict decoder on
    `data` finished some way: an unfinished character's next byte is one of 80 / 90 / A0 (the second byte's
    ranges after E0, ED, F0, F4 differ), then 80s. (Its incremental decoder is no oracle: it holds ED A1 back
    as unfinished, where no completion is valid.)"""
    ends = [b""] + [first + b"\x80" * k for first in (b"\x80", b"\x90", b"\xa0") for k in range(3)]
    for end in ends:
        try:
            (data + end).decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


@pytest.fixture(scope="module")
def guard(demo_kit):
    from services.engine.detokenizer import TokenizerInfo
    from services.engine.grammar import Utf8Guard

    info = TokenizerInfo(demo_kit.base_dir)
    g = Utf8Guard.of(info, len(info.token_bytes))
    assert g is not None
    return g, info


def test_the_utf8_guard_allows_exactly_what_a_strict_decoder_accepts(guard):
    """Every (state, token) against Python's strict UTF-8 decoder, on the demo vocabulary (its byte tokens
    include every lead and continuation byte): allowed iff the state's prefix plus the token's bytes is valid;
    the packed mask agrees with the table bit for bit."""
    g, info = guard
    n = g.next.shape[1]
    bits = ((g.masks[:, :, None] >> torch.arange(32)) & 1).reshape(len(_STATE_PREFIXES), -1)[:, :n].bool()
    for s, prefix in enumerate(_STATE_PREFIXES):
        for t in range(n):
            b = _text(info, t)
            want = _utf8_ok(prefix + b) if b else s == 0  # no bytes: only between characters
            assert (g.next[s, t] != 8) == want == bool(bits[s, t]), (s, t, b)
    f0 = info.token_bytes.index(b"\xf0")
    assert g.next[0, f0] == 6 and g.next[6, info.token_bytes.index(b"\x89")] == 8  # the overlong the test found
    assert g.next[6, info.token_bytes.index(b"\x9f")] == 2


def test_guarded_masks_keep_sampled_bytes_utf8_and_never_empty_a_row(guard):
    """Random walks through the guarded masks (what the sampler may pick) decode strictly; a grammar mask the
    guard would empty is left as the grammar made it."""
    import random

    g, _ = guard
    n = g.next.shape[1]
    rng = random.Random(5)
    for walk in range(20):
        state, data = 0, b""
        for _ in range(60):
            full = torch.full((1, g.masks.shape[1]), -1, dtype=torch.int32)
            g.apply(full, [state])
            allowed = [t for t in range(n) if (int(full[0, t // 32]) >> (t % 32)) & 1]
            t = rng.choice(allowed)
            data += _text(guard[1], t)
            state = int(g.next[state, t])
            assert _utf8_ok(data), (walk, data)
    only_bad = torch.zeros((1, g.masks.shape[1]), dtype=torch.int32)
    bad = guard[1].token_bytes.index(b"\x89")
    only_bad[0, bad // 32] = 1 << (bad % 32)
    kept = only_bad.clone()
    g.apply(kept, [0])  # a continuation byte at a character boundary: not UTF-8, yet all the grammar allows
    assert torch.equal(kept, only_bad)


def _text(info, t: int) -> bytes:
    """A token's bytes as text: none for a special token (as the grammar sees the vocabulary)."""
    return b"" if t in info.special_ids else info.token_bytes[t]
