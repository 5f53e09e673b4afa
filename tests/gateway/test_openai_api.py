"""The gateway through the official OpenAI SDK against real engines, Postgres and Redis."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from services.common.models import UsageEvent
from tests.factories import make_api_key, make_tenant


@pytest.fixture
def tenant_key(db):
    tenant = make_tenant(db)
    key = make_api_key(db, tenant=tenant).secret
    return tenant, key


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gw.url}/v1", api_key=key, max_retries=0)


def _ledger_row(db, request_id: str, timeout: float = 10) -> UsageEvent:
    deadline = time.time() + timeout
    while time.time() < deadline:
        db.expire_all()
        row = db.execute(select(UsageEvent).where(UsageEvent.request_id == request_id)).scalar_one_or_none()
        if row is not None:
            return row
        time.sleep(0.1)
    raise AssertionError(f"no ledger row for {request_id}")


def test_chat_non_streaming_is_sensible_and_metered_exactly(stack, demo_kit, tenant_key, db):
    tenant, key = tenant_key
    raw = client(stack, key).chat.completions.with_raw_response.create(
        model=demo_kit.model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, extra_headers={"X-Client-Request-Id": "my-trace-42"},
    )
    r = raw.parse()
    assert "Paris" in r.choices[0].message.content
    rid = raw.headers["x-request-id"]
    row = _ledger_row(db, rid)
    assert row.tenant_id == tenant.id and row.status == "ok" and row.client_request_id == "my-trace-42"
    assert (row.prompt_tokens, row.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    assert row.engine_id and row.compute_us > 0


def test_streaming_with_include_usage(stack, demo_kit, tenant_key):
    _, key = tenant_key
    chunks = list(client(stack, key).chat.completions.create(
        model=demo_kit.model_name, messages=[{"role": "user", "content": "Hello"}], stream=True,
        stream_options={"include_usage": True}, temperature=0,
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []


def test_completions_and_models(stack, demo_kit, tenant_key):
    _, key = tenant_key
    c = client(stack, key)
    assert [m.id for m in c.models.list().data] == [demo_kit.model_name]
    r = c.completions.create(model=demo_kit.model_name, prompt="Hello", max_tokens=4, n=2, seed=1, temperature=0.7)
    assert len(r.choices) == 2 and 0 < r.usage.completion_tokens <= 8


def test_error_types(stack, demo_kit, tenant_key, db):
    _, key = tenant_key
    with pytest.raises(openai.AuthenticationError):
        client(stack, "mpx_notakey").models.list()
    with pytest.raises(openai.AuthenticationError):
        client(stack, key[:-1] + ("A" if key[-1] != "A" else "B")).models.list()  # checksum catches it
    with pytest.raises(openai.NotFoundError) as nf:
        client(stack, key).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client(stack, key).chat.completions.create(model=demo_kit.model_name, messages=[{"role": "user", "content": "hi"}], top_p=2)
    assert bad.value.body["param"] == "top_p"
    vocab = json.loads((demo_kit.base_dir / "config.json").read_text())["vocab_size"]
    for ids in ([vocab], [5, -1], [-(2**63) - 1]):  # the last one does not even fit in 64 bits (found by schemathesis)
        with pytest.raises(openai.BadRequestError) as bad:
            client(stack, key).completions.create(model=demo_kit.model_name, prompt=ids, max_tokens=2)
        assert bad.value.body["param"] == "prompt" and f"[0, {vocab})" in bad.value.body["message"]
    limited = make_tenant(db, limits={"tokens_per_min": 50})
    small_key = make_api_key(db, tenant=limited).secret
    with pytest.raises(openai.RateLimitError) as rl:
        client(stack, small_key).chat.completions.create(model=demo_kit.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    assert rl.value.body["code"] == "rate_limit_exceeded"
    # prompt + 100 tokens can never fit a 50 tokens/min window: no Retry-After, and SDKs are told not to retry.
    assert "retry-after" not in rl.value.response.headers and rl.value.response.headers["x-should-retry"] == "false"
    assert rl.value.response.headers["x-ratelimit-limit-tokens"] == "50"


def test_cache_salt_is_per_tenant_and_not_client_settable(stack, demo_kit, db):
    prompt = [{"role": "system", "content": "You are precise. " * 10}, {"role": "user", "content": "Hello"}]
    keys = []
    for _ in range(2):
        k = make_api_key(db, tenant=make_tenant(db)).secret
        keys.append(k)

    def cached(key: str) -> int:
        r = client(stack, key).chat.completions.create(
            model=demo_kit.model_name, messages=prompt, max_tokens=1,
            extra_body={"cache_salt": "shared-by-attacker", "tenant_id": "whatever"},
        )
        return r.usage.prompt_tokens_details.cached_tokens

    cached(keys[0])
    assert cached(keys[0]) > 0  # same tenant: the prefix is reused (same engine by affinity)
    assert cached(keys[1]) == 0  # another tenant never hits, whatever salt the client sends


def test_metrics_endpoint_counts_requests(stack, demo_kit, tenant_key):
    _, key = tenant_key
    client(stack, key).chat.completions.create(model=demo_kit.model_name, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    text = httpx.get(f"{stack.gw.url}/metrics").text
    assert 'mplex_gateway_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert "mplex_gateway_tokens_total" in text
