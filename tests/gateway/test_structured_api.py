"""Structured outputs and tool calls through the gateway, with the official OpenAI SDK as the client, against
real engines on the demo model."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema

from tests.factories import make_api_key, make_tenant
from tests.structured_models import MODELS, TOOLS, WEATHER_TOOL, Owner, Pet

PROMPTS = ["Describe a pet.", "Tell me about an owner and their pets.", "Give me a city.", "hello world",
           "What is the weather like?"]


@pytest.fixture
def key(db):
    return make_api_key(db, tenant=make_tenant(db)).secret


def sdk(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gw.url}/v1", api_key=key, max_retries=0, timeout=120)


def _parse_once(client: openai.OpenAI, model: str, i: int):
    fmt = MODELS[i % len(MODELS)]
    temperature = 0.0 if i % 2 == 0 else 1.0
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    if i % 4 < 2:
        done = client.chat.completions.parse(model=model, messages=messages, response_format=fmt,
                                             temperature=temperature, seed=i, max_tokens=400)
    else:
        with client.chat.completions.stream(model=model, messages=messages, response_format=fmt,
                                            temperature=temperature, seed=i, max_tokens=400) as stream:
            done = stream.get_final_completion()
    choice = done.choices[0]
    return fmt, choice


def test_sdk_parse_is_always_schema_valid_stream_and_not_greedy_and_sampled(stack, demo_kit, key):
    client = sdk(stack, key)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _parse_once(client, demo_kit.model_name, i), range(200)))
    assert len(results) == 200
    for fmt, choice in results:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, fmt)
        # The text itself, not only pydantic's reading of it, matches the schema the SDK sent.
        jsonschema_rs.validate(to_strict_json_schema(fmt), json.loads(choice.message.content))
    sampled = {choice.message.content for i, (_, choice) in enumerate(results) if i % 2}
    assert len(sampled) > 50, "temperature 1 gave the same few answers"


def test_json_object_and_length_is_honest(stack, demo_kit, key):
    client = sdk(stack, key)
    r = client.chat.completions.create(model=demo_kit.model_name, messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].finish_reason == "length"
    short = client.chat.completions.create(model=demo_kit.model_name, messages=[{"role": "user", "content": "hi"}],
                                           response_format=Pet_format(), max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content.startswith("{")


def Pet_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "Pet", "schema": to_strict_json_schema(Pet), "strict": True}}


BAD_SCHEMAS = [
    ({"type": "object", "not": {"type": "string"}}, "response_format.json_schema.schema.not"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}},
     "response_format.json_schema.schema.properties.a.multipleOf"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "response_format.json_schema.schema.properties.a.type"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}},
     "response_format.json_schema.schema.properties.a.$ref"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "response_format.json_schema.schema.minimum"),
    ({"type": "string", "pattern": "([a-"}, "response_format.json_schema.schema.pattern"),
    ({"type": "array", "uniqueItems": True}, "response_format.json_schema.schema.uniqueItems"),
    ("not a schema", "response_format.json_schema.schema"),
]


@pytest.mark.parametrize("schema,param", BAD_SCHEMAS)
def test_invalid_or_unsupported_schema_is_a_400_naming_the_field(stack, demo_kit, key, schema, param):
    r = httpx.post(f"{stack.gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": demo_kit.model_name, "messages": [{"role": "user", "content": "hi"}],
                         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = sdk(stack, key).chat.completions.create(model=demo_kit.model_name, max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content is not None  # the engines keep serving


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]},
     "tools[0].function.parameters.if"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_invalid_tools_and_formats_are_400s(stack, demo_kit, key, body, param):
    r = httpx.post(f"{stack.gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": demo_kit.model_name, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def _validate_call(call) -> None:
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema_rs.validate(tool["function"]["parameters"], json.loads(call.function.arguments))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_tool_calls_always_validate(stack, demo_kit, key, temperature):
    client = sdk(stack, key)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(6):
        for choice in ("required", {"type": "function", "function": {"name": "time"}}):
            r = client.chat.completions.create(model=demo_kit.model_name, messages=messages, tools=TOOLS,
                                               tool_choice=choice, temperature=temperature, seed=seed, max_tokens=120,
                                               parallel_tool_calls=seed % 2 == 0)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c
            assert c.message.tool_calls and c.message.content is None
            if seed % 2:
                assert len(c.message.tool_calls) == 1
            for call in c.message.tool_calls:
                _validate_call(call)
                assert call.id.startswith("call_") and call.type == "function"
                if isinstance(choice, dict):
                    assert call.function.name == "time"


def test_streamed_tool_calls_assemble_into_the_non_streamed_call_and_round_trip(stack, demo_kit, key):
    client = sdk(stack, key)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=demo_kit.model_name, messages=messages, tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=120)
    whole_response = client.chat.completions.create(**kw)
    whole = whole_response.choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]

    # The round trip: the assistant's call and the tool's result go back in; the model answers.
    follow = messages + [whole.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": json.dumps({"temperature": 21})}
        for t in whole.message.tool_calls]
    again = client.chat.completions.create(model=demo_kit.model_name, messages=follow, tools=TOOLS, max_tokens=20,
                                           temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert again.usage.prompt_tokens > whole_response.usage.prompt_tokens  # the call and its result were read


def _auto_answer(client: openai.OpenAI, model: str, question: str, stream: bool) -> tuple[str | None, list]:
    """(content, [(name, arguments)]) of a `tool_choice: auto` answer, streamed or not."""
    kw = dict(model=model, messages=[{"role": "user", "content": question}], tools=TOOLS, temperature=0,
              max_tokens=64)
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        assert c.finish_reason == ("tool_calls" if calls else "stop"), c
        return c.message.content, calls
    content, parts, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                p = parts.setdefault(d.index, ["", ""])
                p[0] += d.function.name or ""
                p[1] += d.function.arguments or ""
    calls = [tuple(parts[i]) for i in sorted(parts)]
    assert finish == ("tool_calls" if calls else "stop")
    return content or None, calls


def test_tool_choice_auto_through_the_sdk_decides_on_the_kits_tool_eval(stack, demo_kit, key):
    """The kit's base model is taught to call its tools: under `auto` (the default when tools are offered) it
    calls the right tool, with valid arguments, exactly when the held-out question is that tool's -- streamed
    answers the same as whole ones."""
    from services.modelkit.evaluate import read_eval

    client = sdk(stack, key)
    items = read_eval(demo_kit.tools_eval)
    with ThreadPoolExecutor(8) as pool:
        whole = list(pool.map(lambda it: _auto_answer(client, demo_kit.model_name, it.prompt, False), items))
        streamed = list(pool.map(lambda it: _auto_answer(client, demo_kit.model_name, it.prompt, True), items))
    assert streamed == whole
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    right = 0
    for item, (content, calls) in zip(items, whole):
        for name, arguments in calls:
            jsonschema_rs.validate(schemas[name], json.loads(arguments))
        right += (calls[0][0] if calls else None) == item.tool
    assert right >= 0.8 * len(items), whole


def test_tools_are_counted_as_prompt_tokens(stack, demo_kit, key):
    client = sdk(stack, key)
    messages = [{"role": "user", "content": "hi"}]
    bare = client.chat.completions.create(model=demo_kit.model_name, messages=messages, max_tokens=1)
    offered = client.chat.completions.create(model=demo_kit.model_name, messages=messages, max_tokens=1,
                                             tools=[WEATHER_TOOL], tool_choice="none")
    assert offered.usage.prompt_tokens > bare.usage.prompt_tokens + 20


def test_owner_parse_with_n_and_logprobs(stack, demo_kit, key):
    r = sdk(stack, key).chat.completions.parse(model=demo_kit.model_name, messages=[{"role": "user", "content": "x"}],
                                               response_format=Owner, n=3, temperature=1, seed=7, logprobs=True,
                                               top_logprobs=2, max_tokens=400)
    assert len(r.choices) == 3
    for c in r.choices:
        assert isinstance(c.message.parsed, Owner)
        assert c.logprobs.content and all(t.logprob is not None and t.logprob <= 0 for t in c.logprobs.content)
