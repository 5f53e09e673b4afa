"""Speculative decoding through the real gateway and the OpenAI SDK: a response reports the tokens drafted for
it in OpenAI's `completion_tokens_details` (accepted / rejected prediction tokens), streamed and not, while
usage and the ledger count only the tokens emitted -- the same as without speculation."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import make_api_key, make_tenant
from tests.gateway.test_faults import _isolated, _ledger
from tests.stack import Stack

# A list the demo base model copies (README, "The demo model kit"): prompt lookup drafts the rest of it.
ITEMS = "cat 12 DOG river 7 lamp BOOK 33 sun key 90 moon"


@pytest.fixture(scope="module")
def spec_stack(stack_env, demo_kit, tmp_path_factory):
    """One engine with prompt-lookup speculation on for every model (no gate verdict needed) and a gateway."""
    s = Stack(_isolated(stack_env, 7), tmp_path_factory.mktemp("spec-stack"))
    try:
        s.engines = [s.engine(demo_kit.base_dir, demo_kit.model_name, "spec-eng-0", wait=False,
                              extra=["--speculative", "ngram", "--skip-spec-gate"])]
        s.gw = s.gateway(demo_kit.base_dir, demo_kit.model_name, name="spec-gw", wait=False)
        s.wait_ready(*s.engines, s.gw)
        yield s
    finally:
        s.close()


def _spec_tokens(stack, kind: str) -> float:
    e = stack.engines[0]
    for fam in text_string_to_metric_families(httpx.get(f"{e.url}/metrics", headers=stack.engine_headers()).text):
        for sample in fam.samples:
            if sample.name == "mplex_engine_spec_tokens_total" and sample.labels.get("kind") == kind:
                return sample.value
    return 0.0


def test_usage_reports_drafted_tokens_and_bills_only_emitted_ones(spec_stack, stack, demo_kit, db):
    tenant = make_tenant(db)
    c = openai.OpenAI(base_url=f"{spec_stack.gw.url}/v1", api_key=make_api_key(db, tenant=tenant).secret,
                      max_retries=0, timeout=120)
    body = {"model": demo_kit.model_name, "messages": [{"role": "user", "content": f"Repeat:\n{ITEMS}"}],
            "max_tokens": 40, "temperature": 0}
    drafted0, accepted0 = _spec_tokens(spec_stack, "draft"), _spec_tokens(spec_stack, "accepted")
    answers = [c.chat.completions.create(**body) for _ in range(3)]
    chunks = list(c.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    usages = [a.usage for a in answers] + [chunks[-1].usage]
    texts = [a.choices[0].message.content for a in answers] + ["".join(
        ch.choices[0].delta.content or "" for ch in chunks if ch.choices)]
    assert texts == [ITEMS] * 4  # the copy, exact, on every path

    drafted = _spec_tokens(spec_stack, "draft") - drafted0
    accepted = _spec_tokens(spec_stack, "accepted") - accepted0
    assert drafted > 0 and accepted > 0
    details = [u.completion_tokens_details for u in usages]
    assert all(d is not None for d in details)
    assert sum(d.accepted_prediction_tokens for d in details) == accepted
    assert sum(d.accepted_prediction_tokens + d.rejected_prediction_tokens for d in details) == drafted
    assert all(d.accepted_prediction_tokens <= u.completion_tokens for d, u in zip(details, usages))

    # Billing: the tokens emitted -- what the same request counts on engines that do not speculate (`stack`).
    plain_key = make_api_key(db, tenant=make_tenant(db)).secret
    plain = openai.OpenAI(base_url=f"{stack.gw.url}/v1", api_key=plain_key, max_retries=0, timeout=120)
    plain_usage = plain.chat.completions.create(**body).usage
    assert plain_usage.completion_tokens_details is None  # nothing drafted, nothing reported
    assert {u.completion_tokens for u in usages} == {plain_usage.completion_tokens}
    rows = _ledger(db, tenant.id, 4)
    assert sorted(r.completion_tokens for r in rows) == [plain_usage.completion_tokens] * 4
