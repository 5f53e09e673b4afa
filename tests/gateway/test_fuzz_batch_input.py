"""The batch file check, fuzzed: whatever bytes arrive, it answers with line-numbered errors (never an
exception), every line is either accepted or named in exactly one error, and a body is judged exactly as the
live endpoint judges it (the same request model and planner, on the demo model's real tokenizer)."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from services.common.batch_contract import MAX_LINES
from services.common.errors import ModelNotFoundError
from services.common.openai_protocol import ChatCompletionRequest
from services.common.openai_serving import plan_request
from services.common.prompting import PromptBuilder
from services.common.wire import InvalidRequest
from services.gateway.batch_input import check_file, split_lines
from services.gateway.resolve import BaseModelInfo, ResolvedModel
from tests.fuzzing import fuzz_settings, ints, texts, wrong


@pytest.fixture(scope="module")
def model(demo_kit):
    base = BaseModelInfo.from_dir(demo_kit.model_name, demo_kit.base_dir)
    return base, {base.name: PromptBuilder(demo_kit.base_dir)}


def valid(i: int, model: str, **body) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4, **body}}


def check(data: bytes, base, builders):
    async def resolve(name: str) -> ResolvedModel:
        if name != base.name:
            raise ModelNotFoundError(name)
        return ResolvedModel(name, base, None)

    return asyncio.run(check_file(data, resolve, builders))


@given(data=st.binary(max_size=2000))
@fuzz_settings(300)
def test_any_bytes_get_line_numbered_errors_never_an_exception(data):
    out = split_lines(data)
    n_lines = len(data.split(b"\n")) - (1 if data.split(b"\n")[-1].strip() == b"" else 0)
    assert out.errors or out.lines
    for e in out.errors:
        assert 1 <= e.line <= max(n_lines, 1) + 1 and e.message
    if n_lines and n_lines <= MAX_LINES:
        # each line is accepted or refused, never both, never neither
        assert sorted(out.numbers + [e.line for e in out.errors]) == list(range(1, n_lines + 1))


CORRUPTIONS = {
    "not_json": lambda d: b"{not json",
    "not_object": lambda d: b"[1, 2]",
    "no_custom_id": lambda d: json.dumps({k: v for k, v in d.items() if k != "custom_id"}).encode(),
    "bad_method": lambda d: json.dumps({**d, "method": "GET"}).encode(),
    "bad_url": lambda d: json.dumps({**d, "url": "/v1/embeddings"}).encode(),
    "extra_field": lambda d: json.dumps({**d, "tenant": "someone-else"}).encode(),
    "body_not_object": lambda d: json.dumps({**d, "body": "x"}).encode(),
}


@given(n=st.integers(1, 30), data=st.data())
@fuzz_settings(60)
def test_corrupted_lines_are_named_by_number_and_the_rest_pass(n, data, model):
    base, builders = model
    lines = [valid(i, base.name) for i in range(n)]
    bad = data.draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from(sorted(CORRUPTIONS)), max_size=n))
    raw = [CORRUPTIONS[bad[i]](d) if i in bad else json.dumps(d).encode() for i, d in enumerate(lines)]
    out = check(b"\n".join(raw) + b"\n", base, builders)
    assert sorted(e.line for e in out.errors) == sorted(i + 1 for i in bad)
    assert out.numbers == [i + 1 for i in range(n) if i not in bad]


def test_duplicate_custom_ids_name_both_lines(model):
    base, builders = model
    out = check(b"\n".join(json.dumps(valid(i % 2, base.name)).encode() for i in range(3)), base, builders)
    assert [(e.line, e.param, e.code) for e in out.errors] == [(3, "custom_id", "duplicate_custom_id")]
    assert "line 1" in out.errors[0].message


@given(field=st.sampled_from(["max_tokens", "temperature", "top_p", "n", "messages", "model", "stop", "seed",
                              "logprobs", "top_logprobs", "stream", "priority", "presence_penalty"]),
       value=st.one_of(ints, wrong, texts))
@fuzz_settings(300)
def test_a_body_passes_exactly_when_the_live_endpoint_would_take_it(field, value, model):
    base, builders = model
    line = valid(0, base.name)
    line["body"][field] = value
    out = check(json.dumps(line).encode(), base, builders)
    live_ok = _live_accepts(line["body"], base, builders)
    assert (not out.errors) == live_ok, (field, value, [e.describe() for e in out.errors])
    for e in out.errors:  # a lone surrogate escape fails the line's JSON itself (orjson refuses it)
        assert e.line == 1 and ((e.param or "").startswith("body") or e.code == "invalid_json")


def _live_accepts(body: dict, base, builders) -> bool:
    """What POST /v1/chat/completions does with this body: parse, resolve, plan (and a batch cannot stream)."""
    try:
        req = ChatCompletionRequest.model_validate(body)
        if req.stream or req.model != base.name:
            return False
        plan_request("chat", req, builders[base.name], base.max_model_len)
    except (ValidationError, InvalidRequest):
        return False
    return True


def test_another_tenants_adapter_is_named_like_a_missing_model(model):
    base, builders = model
    out = check(json.dumps(valid(0, base.name)).encode() + b"\n" + json.dumps(valid(1, "their-adapter")).encode(),
                base, builders)
    [e] = out.errors
    assert (e.line, e.param, e.code) == (2, "body.model", "model_not_found") and "their-adapter" in e.message
