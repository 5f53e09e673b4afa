"""The structured-output contract without an engine: schema checks name the field, guides hash by content,
tool calls render into a plain template and parse back the same whole or streamed in any pieces."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.openai_protocol import ChatCompletionRequest, Delta, ResponseBuilder
from services.common.structured import GUIDE_JSON_SCHEMA, GUIDE_TOOL_CALLS, Guide, check_schema
from services.common.tool_calls import (CALL_SEPARATOR, ToolCallStream, flatten_tool_messages, render_call,
                                        split_output)
from services.common.wire import InvalidRequest
from tests.structured_models import TOOLS


@pytest.mark.parametrize("schema,param", [
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}, "s.properties.a.oneOf"),
    ({"type": "array", "items": {"type": "string", "minLength": -1}}, "s.items.minLength"),
    ({"type": ["string", "dict"]}, "s.type"),
    ({"anyOf": []}, "s.anyOf"),
    ({"type": "string", "format": "hostname"}, "s.format"),
    ({"type": "string", "maxLength": 3, "pattern": "a+"}, "s.pattern"),
    ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "s.allOf"),
    ({"$defs": {"A": {"type": "integer", "minimum": 2, "maximum": 1}}, "$ref": "#/$defs/A"}, "s.$defs.A.minimum"),
])
def test_schema_refusals_name_the_field(schema, param):
    with pytest.raises(InvalidRequest) as e:
        check_schema(schema, "s")
    assert e.value.param == param


def test_guides_are_keyed_by_content_and_keep_property_order():
    a = Guide(GUIDE_JSON_SCHEMA, schema={"type": "object", "properties": {"b": {}, "a": {}}})
    b = Guide.parse(a.text)
    assert a == b and a.key == b.key and len(a.key) == 64
    assert list(json.loads(a.text)["schema"]["properties"]) == ["b", "a"]
    assert Guide(GUIDE_JSON_SCHEMA, schema={"type": "object", "properties": {"a": {}, "b": {}}}).key != a.key


def test_chat_request_builds_guides_and_refuses_what_it_cannot_honour():
    def req(**kw):
        return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)

    assert req().guide() is None and req(response_format={"type": "text"}).guide() is None
    named = req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "time"}}).guide()
    assert named.kind == GUIDE_TOOL_CALLS and [t.name for t in named.tools] == ["time"] and not named.parallel
    assert req(tools=TOOLS, tool_choice="required", parallel_tool_calls=True).guide().parallel
    # auto: the model may answer in text; a call it opens is held to the tools (optional), at most one
    # without parallel calls; with min_tokens (the end token banned) no grammar at all.
    auto = req(tools=TOOLS).guide()
    assert auto.kind == GUIDE_TOOL_CALLS and auto.optional and auto.parallel and req(tools=TOOLS).parses_tool_calls
    assert [t.name for t in auto.tools] == ["weather", "time"] and Guide.parse(auto.text) == auto
    assert not req(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False).guide().parallel
    assert req(tools=TOOLS, min_tokens=2).guide() is None and req(tools=TOOLS, min_tokens=2).parses_tool_calls
    assert not named.optional and "optional" not in named.text  # forced guides keep their content hash
    assert req(tools=TOOLS, tool_choice="none").guide() is None
    assert not req(tools=TOOLS, tool_choice="none").parses_tool_calls
    with pytest.raises(InvalidRequest) as e:
        req(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}).guide()
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequest) as e:
        req(tools=TOOLS + [TOOLS[0]]).guide()
    assert e.value.param == "tools[2].function.name"
    # Chat templates write a description into the prompt: a non-string one is the request's 400, not a 500.
    with pytest.raises(InvalidRequest) as e:
        req(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]).guide()
    assert e.value.param == "tools[0].function.description"
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)}}
    with pytest.raises(InvalidRequest) as e:
        req(response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": big}}).guide()
    assert e.value.param == "response_format"


def test_tool_messages_flatten_for_a_plain_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
    msgs = flatten_tool_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12C"},
    ], TOOLS)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert '"name":"weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == render_call("weather", '{"city":"Oslo"}')
    assert "12C" in msgs[3]["content"] and "tool_call" not in msgs[3]
    content, calls = split_output(msgs[2]["content"])
    assert content is None and calls[0].name == "weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}


_PIECES = st.sampled_from([render_call("weather", '{"city": "Oslo", "days": 2}'), render_call("time", '{"zone": "UTC"}'),
                           CALL_SEPARATOR, "Sure. ", "<tool", "<tool_call>\nnot json\n</tool_call>", " ", "\n",
                           "a < b", "<tool_call>", "plain words"])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_PIECES, max_size=6), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_streamed_split_equals_the_whole_split_for_any_pieces(parts, cuts):
    text = "".join(parts)
    whole_content, whole_calls = split_output(text)
    stream = ToolCallStream()
    content, calls = "", []
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    for a, b in zip(bounds, bounds[1:]):
        piece, new = stream.push(text[a:b])
        content += piece
        calls += new
    tail, _ = stream.flush()
    content += tail
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert (None if calls and not content.strip() else content) == whole_content


def test_streamed_chunks_carry_openai_tool_call_deltas():
    b = ResponseBuilder("chat", "id", "m", 1, False, parse_tools=True)
    text = render_call("weather", '{"city": "Oslo", "days": 2}') + CALL_SEPARATOR + render_call("time", '{"zone": "UTC"}')
    chunks = [b.chunk(Delta(0, text[i:i + 5], finish_reason="stop" if i + 5 >= len(text) else None))
              for i in range(0, len(text), 5)]
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    flat = [d for ds in deltas for d in ds]
    assert [d["index"] for d in flat] == [0, 1] and [d["function"]["name"] for d in flat] == ["weather", "time"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["choices"][0]["delta"]["content"] in ("", None) for c in chunks)
