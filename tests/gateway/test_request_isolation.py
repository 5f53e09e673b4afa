"""No request can hurt another tenant: each case that once stopped an engine, stalled the gateway or
slipped past a limit, through the real gateway and engines, with the engines checked afterwards.

(The fuzz suite, tests/gateway/test_fuzz_http.py, looks for the cases nobody listed.)
"""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from sqlalchemy import select

from services.common.models import UsageEvent
from tests.factories import make_api_key, make_tenant


@pytest.fixture
def tenant_key(db):
    tenant = make_tenant(db)
    return tenant, make_api_key(db, tenant=tenant).secret


def _client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gw.url}/v1", api_key=key, max_retries=0)


def _engines_serve(stack, model: str) -> None:
    """Every engine is alive and serves a request of its own (not just answering /health)."""
    auth = stack.engine_headers()
    for e in stack.engines:
        assert httpx.get(f"{e.url}/health").json() == {"status": "ok"}
        r = httpx.post(f"{e.url}/v1/completions", headers=auth, timeout=60,
                       json={"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def _bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    assert exc.value.status_code == 400
    return exc.value.body


# -- sampling values that stopped every engine ---------------------------------------------------------
@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, -(2**63), 2**63 - 1])
def test_any_64_bit_seed_is_served_and_reproducible(stack, demo_kit, tenant_key, seed):
    _, key = tenant_key
    ask = dict(model=demo_kit.model_name, messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
               temperature=0.9, seed=seed)
    a = _client(stack, key).chat.completions.create(**ask)
    b = _client(stack, key).chat.completions.create(**ask)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage.completion_tokens == 6
    _engines_serve(stack, demo_kit.model_name)


@pytest.mark.parametrize("extra,param", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 1537}, "top_k"),  # wider than the vocabulary
    ({"stop_token_ids": [5000], "min_tokens": 2}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 2**63}, "min_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"temperature": 101}, "temperature"),
    ({"logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"n": 9}, "n"),
])
def test_out_of_range_sampling_is_a_400_naming_the_field_and_engines_keep_serving(stack, demo_kit, tenant_key, extra, param):
    _, key = tenant_key
    sdk = {k: v for k, v in extra.items() if k in ("seed", "max_tokens", "temperature", "logprobs", "top_logprobs", "stop", "n")}
    ext = {k: v for k, v in extra.items() if k not in sdk}  # vLLM's extensions travel in the body
    sdk.setdefault("max_tokens", 4)
    body = _bad_request(lambda: _client(stack, key).chat.completions.create(
        model=demo_kit.model_name, messages=[{"role": "user", "content": "Hello"}], extra_body=ext, **sdk))
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"]
    _engines_serve(stack, demo_kit.model_name)


def test_the_same_values_sent_straight_to_an_engine_are_refused_there_too(stack, demo_kit):
    """The engine's internal stream checks by the same contract (anyone holding the credential, or a
    gateway of another version, cannot get past it)."""
    auth = stack.engine_headers()
    for sampling, param in (({"seed": 2**64}, "seed"), ({"top_k": 2**63}, "top_k"),
                            ({"stop_token_ids": [5000], "min_tokens": 2}, "stop_token_ids"),
                            ({"top_k": 1.5}, "top_k"), ({"temperature": "hot"}, "temperature"),
                            ({"stop": "abc"}, "sampling.stop")):
        r = httpx.post(f"{stack.engines[0].url}/internal/v1/generate", headers=auth, timeout=30,
                       json={"request_id": "direct-1", "prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 4, **sampling}})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.headers["x-mplex-fault"] == "request"
    _engines_serve(stack, demo_kit.model_name)


# -- invalid Unicode ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[0].text"),
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\ud800"]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/completions", {"prompt": "hi", "user": "\udc00"}, "user"),
])
def test_lone_surrogates_are_a_400_naming_the_field_with_no_ledger_row(stack, demo_kit, tenant_key, db, path, body, param):
    tenant, key = tenant_key
    data = json.dumps({"model": demo_kit.model_name, "max_tokens": 2, **body})  # ensure_ascii: \ud800 escapes
    r = httpx.post(f"{stack.gw.url}{path}", content=data, timeout=30,
                   headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "Unicode" in err["message"]
    time.sleep(0.3)
    db.expire_all()
    assert db.execute(select(UsageEvent).where(UsageEvent.tenant_id == tenant.id)).first() is None
    _engines_serve(stack, demo_kit.model_name)


# -- sizes ----------------------------------------------------------------------------------------------
def test_megabyte_prompts_are_refused_before_tokenizing_and_do_not_stall_others(stack, demo_kit, tenant_key):
    _, key = tenant_key
    big = "word " * 200_000  # 1 MB: more characters than any prompt that fits the context can have
    t0 = time.perf_counter()
    body = _bad_request(lambda: _client(stack, key).chat.completions.create(
        model=demo_kit.model_name, messages=[{"role": "user", "content": big}], max_tokens=2))
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    body = _bad_request(lambda: _client(stack, key).completions.create(model=demo_kit.model_name, prompt=big, max_tokens=2))
    assert body["code"] == "context_length_exceeded" and body["param"] == "prompt"
    print(f"\n[isolation] two 1 MB prompts refused in {time.perf_counter() - t0:.3f}s")


def test_oversized_bodies_are_413_whether_declared_or_streamed(stack, tenant_key):
    _, key = tenant_key
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    declared = httpx.post(f"{stack.gw.url}/v1/completions", headers=headers, content=b"x" * (8 * 2**20), timeout=60)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(160):  # 10 MB, no Content-Length
            yield b" " * 65536

    streamed = httpx.post(f"{stack.gw.url}/v1/completions", headers=headers, content=chunks(), timeout=60)
    assert streamed.status_code == 413
    auth = stack.engine_headers()
    r = httpx.post(f"{stack.engines[0].url}/internal/v1/generate", headers={**auth, "content-type": "application/json"},
                   content=b"x" * (8 * 2**20), timeout=60)
    assert r.status_code == 413


def test_a_one_megabyte_header_is_431_at_the_transport(stack):
    for url in (stack.gw.url, stack.engines[0].url):
        host, port = urlsplit(url).hostname, urlsplit(url).port
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")
            sent = 0
            try:
                while sent < 2**20:
                    s.sendall(b"a" * 65536)
                    sent += 65536
                s.sendall(b"\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server stopped reading and closed: what we want
            head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 431"), head[:100]
        assert httpx.get(f"{url}/health").status_code == 200
    # Through an ordinary client as well.
    r = httpx.get(f"{stack.gw.url}/v1/models", headers={"authorization": "Bearer " + "a" * 2**20})
    assert r.status_code == 431


def test_prompt_lists_and_choices_are_capped(stack, demo_kit, tenant_key):
    _, key = tenant_key
    c = _client(stack, key)
    body = _bad_request(lambda: c.completions.create(model=demo_kit.model_name, prompt=["hi"] * 100, max_tokens=1))
    assert body["param"] == "prompt" and "64" in body["message"]
    body = _bad_request(lambda: c.completions.create(model=demo_kit.model_name, prompt=["hi"] * 20, n=4, max_tokens=1))
    assert body["param"] == "n"
    assert len(c.completions.create(model=demo_kit.model_name, prompt=["hi"] * 16, n=4, max_tokens=1).choices) == 64


def test_every_choice_counts_against_concurrent_requests(stack, demo_kit, db):
    key = make_api_key(db, tenant=make_tenant(db, limits={"concurrent_requests": 4})).secret
    with pytest.raises(openai.RateLimitError) as rl:
        _client(stack, key).completions.create(model=demo_kit.model_name, prompt=[f"p{i}" for i in range(5)], max_tokens=2)
    assert "can never be admitted" in rl.value.body["message"] and rl.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.RateLimitError):
        _client(stack, key).completions.create(model=demo_kit.model_name, prompt="hi", n=5, max_tokens=2)
    assert len(_client(stack, key).completions.create(model=demo_kit.model_name, prompt=["a", "b"], n=2,
                                                      max_tokens=2).choices) == 4


def test_retry_after_is_the_time_left_in_the_window(stack, demo_kit, db):
    key = make_api_key(db, tenant=make_tenant(db, limits={"requests_per_min": 1})).secret
    c = _client(stack, key)
    refused = None
    for _ in range(3):  # two calls straddling a minute boundary both pass: then the third is refused
        try:
            c.completions.create(model=demo_kit.model_name, prompt="hi", max_tokens=1)
        except openai.RateLimitError as exc:
            refused = exc
            break
    assert refused is not None
    left = 60 - time.time() % 60
    retry = int(refused.response.headers["retry-after"])
    assert 1 <= retry <= 60 and abs(retry - left) <= 2, (retry, left)


# -- the engine port ------------------------------------------------------------------------------------
def test_the_engine_port_refuses_callers_without_the_platform_credential(stack, demo_kit, tenant_key):
    e = stack.engines[0].url
    payload = {"request_id": "x-1", "prompt_token_ids": [5, 6], "cache_salt": "another-tenant",
               "adapter": {"content_id": "0" * 64, "uri": "file:///etc"}}
    for method, path, body in (("POST", "/internal/v1/generate", payload), ("POST", "/drain", None),
                               ("POST", "/internal/v1/adapters", {"name": "x", "path": "/etc"}),
                               ("GET", "/metrics", None), ("POST", "/v1/completions", {"model": demo_kit.model_name, "prompt": "hi"})):
        r = httpx.request(method, f"{e}{path}", json=body)
        assert r.status_code == 401, (path, r.status_code)
    assert httpx.get(f"{e}/health").status_code == 200
    _, key = tenant_key
    assert _client(stack, key).completions.create(model=demo_kit.model_name, prompt="hi", max_tokens=1).choices
