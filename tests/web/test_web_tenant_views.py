"""Tenant pages of issue 26 in real Chromium at 1440 px and 390 px, against the real stack: spend over time in
dollars, breakdowns by adapter / model / API key that add up to the bill, the token budget in dollars too, one
consistent set of meters (no duplicate), the period kept in the URL (and the period chip bug), API keys as cards on
a phone, and the playground streaming through the real /v1 API with a temporary key or the user's own key."""
from __future__ import annotations

import re
import uuid
from datetime import datetime, timezone

import httpx
import pytest
from openai import OpenAI
from playwright.sync_api import expect
from sqlalchemy import text
from sqlalchemy.orm import Session

from tests.web.helpers import (
    DEMO_PRICES,
    PICO_PER_MICRO,
    WIDTH_IDS,
    WIDTHS,
    _half_up,
    ledger_count,
    ledger_totals,
    micro_usd,
    shot,
    sign_in,
    tid,
    visit,
    wait_for,
)
from tests.web.test_web_tenant import month_of


@pytest.fixture(scope="module")
def traffic(web_stack):
    """Calls from two of the demo tenant's keys (the seeded one twice, a second one once), in the ledger."""
    from services.common.models import Tenant
    from tests.factories import make_api_key

    with Session(web_stack.db_engine, expire_on_commit=False) as s:
        second = make_api_key(s, tenant=s.get(Tenant, web_stack.tenant_id), name=f"batch-{uuid.uuid4().hex[:6]}")
    before = ledger_count(web_stack.db_engine, tenant_id=web_stack.tenant_id)
    for key, n in ((web_stack.api_key, 2), (second.secret, 1)):
        client = OpenAI(base_url=f"{web_stack.url}/v1", api_key=key, max_retries=0)
        for i in range(n):
            client.chat.completions.create(model=web_stack.kit.model_name, max_tokens=5 + i, temperature=0,
                                           messages=[{"role": "user", "content": f"Reverse: blue sky {i}"}])
    wait_for(lambda: ledger_count(web_stack.db_engine, tenant_id=web_stack.tenant_id) == before + 3, what="the calls in the ledger")
    return second


def billed_cells(page, table: str) -> list[int]:
    return [int(c.get_attribute("data-microusd")) for c in tid(page, table).locator("tbody td[data-label='Billed']").all()]


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_usage_shows_dollars_over_time_breakdowns_budget_and_keeps_the_period_in_the_url(page, web_stack, traffic, viewport):
    sign_in(page, "admin@demo.test")
    today = datetime.now(timezone.utc).date()
    month = ledger_totals(web_stack.db_engine, *month_of(today), web_stack.tenant_id)

    # Spend over time, in dollars: the chart states the period's total, the same figure as the totals strip.
    expect(tid(page, "usage-totals")).to_be_visible()
    assert micro_usd(page, "usage-total-billed") == month["billed_microusd"] > 0
    label = tid(page, "spend-chart").locator("canvas").get_attribute("aria-label")
    assert f"{tid(page, 'usage-total-billed').inner_text()} in total" in label and "Spend per day" in label

    # One set of meters: the budget once (no "tokens this month" twin), all four the same card, bars level.
    expect(tid(page, "meter-monthly-tokens")).to_have_count(0)
    labels = page.locator(".meters .meter-label").all_inner_texts()
    assert labels == ["Monthly token budget", "Tokens per minute", "Requests per minute", "Concurrent requests"]
    boxes = [m.bounding_box() for m in page.locator(".meters > .meter").all()]
    tracks = [t.bounding_box() for t in page.locator(".meters > .meter .meter-track").all()]
    for y in {round(b["y"]) for b in boxes}:  # meters side by side are equally tall
        row = [b["height"] for b in boxes if round(b["y"]) == y]
        assert max(row) - min(row) < 2, boxes
    assert max(b["width"] for b in boxes) - min(b["width"] for b in boxes) < 2, boxes
    assert {round(t["y"] - b["y"]) for t, b in zip(tracks, boxes)} == {round(tracks[0]["y"] - boxes[0]["y"])}
    if viewport["width"] >= 1000:
        assert len({round(b["y"]) for b in boxes}) == 1  # one row on a desktop

    # The budget in tokens and in dollars, at this month's average price per token.
    spend = page.context.request.get("/api/tenant/spend").json()
    used = spend["budget"]["used_tokens"]
    expect(tid(page, "budget-meter-value")).to_contain_text(f"{used:,} of {spend['budget']['monthly_token_budget']:,} tokens")
    dollars = spend["budget_in_dollars"]
    assert dollars["budget_microusd"] == spend["budget"]["monthly_token_budget"] * month["billed_microusd"] // used
    expect(tid(page, "budget-dollars")).to_have_attribute("data-microusd", str(dollars["budget_microusd"]))
    expect(tid(page, "budget-dollars")).to_contain_text("per 1M tokens")

    # Breakdowns add up to the bill: by adapter (the default), by API key, by model; the choice is in the URL.
    expect(tid(page, "breakdown-adapter")).to_have_attribute("aria-pressed", "true")
    expect(tid(page, "breakdown-row-base model")).to_be_visible()
    tid(page, "breakdown-key").click()
    expect(page).to_have_url(re.compile(r"[?&]by=key"))
    expect(tid(page, f"breakdown-row-{traffic.row.id}")).to_be_visible()
    demo_key = page.context.request.get("/api/tenant/keys").json()["data"]
    demo_key_id = next(k["id"] for k in demo_key if k["name"] == "demo")
    expect(tid(page, f"breakdown-row-{demo_key_id}")).to_contain_text("demo")
    assert sum(billed_cells(page, "breakdown-table")) == month["billed_microusd"]
    expect(tid(page, "breakdown-total").locator("td[data-label='Billed']")).to_have_attribute("data-microusd", str(month["billed_microusd"]))
    with Session(web_stack.db_engine) as s:
        second_requests = s.execute(text("SELECT count(*) FROM usage_events WHERE api_key_id = :k"), {"k": traffic.row.id}).scalar_one()
    expect(tid(page, f"breakdown-row-{traffic.row.id}").locator("td[data-label='Requests']")).to_have_text(str(second_requests))
    tid(page, "breakdown-model").click()
    expect(tid(page, f"breakdown-row-{web_stack.kit.model_name}")).to_be_visible()
    assert sum(billed_cells(page, "breakdown-table")) == month["billed_microusd"]
    visit(page, "usage-breakdown-by-model")

    # The period lives in the URL: a preset writes it, Back returns, Forward comes back, a reload keeps it (and
    # the breakdown). Back is taken before the reload: once in three full runs, Back after a reload stayed on the
    # preset (likely Chromium's history intervention skipping an entry made before the reload), a flake.
    first_of_month = month_of(today)[0].isoformat()
    tid(page, "period-last-7").click()
    expect(page).to_have_url(re.compile(r"[?&]from=\d{4}-\d\d-\d\d&to=\d{4}-\d\d-\d\d"))
    chosen = dict(re.findall(r"(from|to)=([\d-]+)", page.url))
    page.go_back()
    expect(tid(page, "period-from")).to_have_value(first_of_month)
    page.go_forward()
    expect(tid(page, "period-from")).to_have_value(chosen["from"])
    page.reload()
    expect(tid(page, "period-from")).to_have_value(chosen["from"])
    expect(tid(page, "period-to")).to_have_value(chosen["to"])
    expect(tid(page, "period-last-7")).to_have_attribute("aria-pressed", "true")
    expect(tid(page, "breakdown-model")).to_have_attribute("aria-pressed", "true")

    # Bug (6): after typing an invalid range the previously applied chip no longer looks selected.
    tid(page, "period-this-month").click()
    expect(tid(page, "period-this-month")).to_have_attribute("aria-pressed", "true")
    tid(page, "period-from").fill("2999-01-01")
    tid(page, "period-apply").click()
    expect(tid(page, "period-error")).to_contain_text("start date")
    expect(page.locator(".presets [aria-pressed='true']")).to_have_count(0)
    visit(page, "usage-invalid-period")


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_api_keys_are_cards_on_a_phone_and_a_table_on_a_desktop(page, web_stack, viewport):
    sign_in(page, "admin@demo.test")
    tid(page, "nav-keys").click()
    row = page.locator("[data-testid^='key-row-']").first
    expect(row).to_be_visible()
    display = row.evaluate("e => getComputedStyle(e).display")
    header = tid(page, "keys-table").locator("thead").bounding_box()
    if viewport["width"] < 700:
        assert display == "block"  # one card per key
        assert header["width"] <= 1 and header["height"] <= 1  # the column headers are read out, not shown
        assert row.bounding_box()["width"] <= viewport["width"]
        label = row.locator("td[data-label='Created']").evaluate("e => getComputedStyle(e, '::before').content")
        assert "Created" in label or "attr" in label
    else:
        assert display == "table-row" and header["height"] > 10
    visit(page, "keys")


def price_of(prompt: int, cached: int, completion: int) -> int:
    pico = (prompt - cached) * DEMO_PRICES["input"] + cached * DEMO_PRICES["cached_input"] + completion * DEMO_PRICES["output"]
    return _half_up(pico, PICO_PER_MICRO)


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_playground_streams_through_v1_with_a_temporary_key_and_shows_tokens_cost_and_code(page, web_stack, viewport):
    v1_requests = []
    page.on("request", lambda r: v1_requests.append(r) if "/v1/" in r.url else None)
    minted = []
    page.on("response", lambda r: minted.append(r) if r.url.endswith("/api/tenant/playground/key") and r.status == 201 else None)
    sign_in(page, "member@demo.test")  # a member, who cannot create keys, can still try the models
    tid(page, "nav-playground").click()
    model = tid(page, "playground-model")
    expect(model).to_be_visible()
    assert web_stack.kit.model_name in model.locator("option").all_inner_texts()[0]
    model.select_option(web_stack.kit.model_name)
    tid(page, "playground-prompt").fill("Uppercase: red boat")
    tid(page, "playground-max-tokens").fill("8")
    tid(page, "playground-temperature").fill("0")
    tid(page, "playground-send").click()
    out = tid(page, "playground-output")
    expect(out).to_have_attribute("data-phase", "done", timeout=60_000)
    assert out.inner_text().strip()

    # Tokens as the stream's usage said, and the cost the ledger recorded for exactly that request.
    expect(tid(page, "playground-cost")).to_have_attribute("data-microusd", re.compile(r"^\d+$"), timeout=30_000)
    request_id = tid(page, "playground-request-id").inner_text()
    key = minted[-1].json()
    with Session(web_stack.db_engine) as s:
        ev = s.execute(text("SELECT prompt_tokens, cached_tokens, completion_tokens, api_key_id, tenant_id FROM usage_events "
                            "WHERE request_id = :r"), {"r": request_id}).one()
        key_name = s.execute(text("SELECT name FROM api_keys WHERE id = :k"), {"k": ev.api_key_id}).scalar_one()
    assert str(ev.api_key_id) == key["id"] and ev.tenant_id == web_stack.tenant_id
    assert key_name == "Playground · member@demo.test"
    expect(tid(page, "playground-prompt-tokens")).to_have_text(f"{ev.prompt_tokens:,}")
    expect(tid(page, "playground-completion-tokens")).to_have_text(str(ev.completion_tokens))
    assert 0 < ev.completion_tokens <= 8
    assert micro_usd(page, "playground-cost") == price_of(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)

    # The browser sent the temporary key as a bearer token and never its session cookie to /v1.
    assert v1_requests and all("cookie" not in r.all_headers() for r in v1_requests)
    assert all(r.all_headers()["authorization"] == f"Bearer {key['key']}" for r in v1_requests)
    assert key["key"] not in page.content()

    # The same call as curl and as Python, with no key in either.
    curl = tid(page, "playground-curl").inner_text()
    assert f'"model": "{web_stack.kit.model_name}"' in curl and "$MULTIPLEX_API_KEY" in curl and "mpx_" not in curl
    assert f"{web_stack.url}/v1/chat/completions" in curl and '"max_tokens": 8' in curl
    tid(page, "playground-snippet-python").click()
    python = tid(page, "playground-python").inner_text()
    assert f'model="{web_stack.kit.model_name}"' in python and 'os.environ["MULTIPLEX_API_KEY"]' in python
    visit(page, "playground")

    # Or with one of the tenant's own keys, pasted (kept in memory, sent to /v1 only).
    tid(page, "playground-auth-key").click()
    tid(page, "playground-key").fill(web_stack.api_key)
    tid(page, "playground-use-key").click()
    expect(tid(page, "playground-model")).to_be_visible()
    tid(page, "playground-send").click()
    expect(out).to_have_attribute("data-phase", "done", timeout=60_000)
    expect(tid(page, "playground-request-id")).not_to_have_text(request_id, timeout=30_000)
    with Session(web_stack.db_engine) as s:
        used_key = s.execute(text("SELECT k.name FROM usage_events e JOIN api_keys k ON k.id = e.api_key_id WHERE e.request_id = :r"),
                             {"r": tid(page, "playground-request-id").inner_text()}).scalar_one()
    assert used_key == "demo"
    shot(page, "playground-own-key")

    # The keys page shows the temporary key for what it is; signing out revokes it.
    tid(page, "nav-keys").click()
    expect(tid(page, f"key-expires-{key['id']}")).to_contain_text("temporary")
    assert httpx.get(f"{web_stack.url}/v1/models", headers={"authorization": f"Bearer {key['key']}"}).status_code == 200
    tid(page, "sign-out").click()
    expect(tid(page, "login-form")).to_be_visible()
    assert httpx.get(f"{web_stack.url}/v1/models", headers={"authorization": f"Bearer {key['key']}"}).status_code == 401
