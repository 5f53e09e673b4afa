"""Tenant pages in a real browser: a tenant admin's key works with the OpenAI SDK and its tokens show up in the
usage chart, table and spend exactly; a tenant member sees no key controls and the API refuses them."""
from __future__ import annotations

import uuid
from datetime import date, datetime, timezone

import pytest
from openai import OpenAI
from playwright.sync_api import expect
from sqlalchemy import text

from tests.web.helpers import PHONE, csrf_token, ledger_count, ledger_totals, micro_usd, number, sign_in, tid, wait_for

PROMPTS = ("Uppercase: red boat", "Reverse: the cat sat on the mat")


def month_of(today: date) -> tuple[date, date]:
    first = today.replace(day=1)
    nxt = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return first, date.fromordinal(nxt.toordinal() - 1)


def key_last_used(web_stack, key_id: str):
    with web_stack.db_engine.connect() as conn:
        return conn.execute(text("SELECT last_used_at FROM api_keys WHERE id = :k"), {"k": key_id}).scalar_one()


def shown_usage(page) -> dict[str, int]:
    """The period's totals strip, or zeros while the page says there is no usage."""
    expect(tid(page, "usage-totals").or_(tid(page, "usage-empty"))).to_be_visible()
    if tid(page, "usage-empty").is_visible():
        return dict.fromkeys(("requests", "prompt_tokens", "completion_tokens"), 0)
    return {"requests": number(page, "usage-total-requests"), "prompt_tokens": number(page, "usage-total-prompt-tokens"),
            "completion_tokens": number(page, "usage-total-completion-tokens")}


def test_tenant_admin_creates_a_key_calls_the_api_and_sees_the_tokens_and_spend(page, web_stack):
    sign_in(page, "admin@demo.test")
    expect(page).to_have_url(f"{web_stack.url}/usage")
    expect(tid(page, "current-user-role")).to_contain_text("Tenant admin")
    before = shown_usage(page)

    # Create a key: the secret is shown once, with a working copy button.
    tid(page, "nav-keys").click()
    name = f"browser-{uuid.uuid4().hex[:6]}"
    tid(page, "create-key-name").fill(name)
    tid(page, "create-key").click()
    secret_box = tid(page, "new-key-secret")
    expect(secret_box).to_be_visible()
    secret = secret_box.input_value()
    assert secret.startswith("mpx_") and len(secret) > 30
    tid(page, "copy-key").click()
    expect(tid(page, "copy-key-status")).to_contain_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    row = page.locator("[data-testid^='key-row-']", has_text=name)
    expect(row).to_have_count(1)
    key_id = row.get_attribute("data-testid").removeprefix("key-row-")
    assert secret not in row.inner_text()  # the list shows the prefix only
    tid(page, "dismiss-new-key").click()
    expect(tid(page, "new-key")).to_have_count(0)
    page.reload()
    expect(tid(page, f"key-row-{key_id}")).to_be_visible()
    assert secret not in page.content()  # never shown again
    expect(tid(page, f"key-last-used-{key_id}")).to_contain_text("never")

    # Two calls through the OpenAI SDK with the new key.
    client = OpenAI(base_url=f"{web_stack.url}/v1", api_key=secret, max_retries=0)
    usages = [client.chat.completions.create(model=web_stack.kit.model_name, max_tokens=m, temperature=0,
                                             messages=[{"role": "user", "content": p}]).usage
              for p, m in zip(PROMPTS, (6, 9))]
    sent = {"requests": 2, "prompt_tokens": sum(u.prompt_tokens for u in usages),
            "completion_tokens": sum(u.completion_tokens for u in usages)}
    assert sent["prompt_tokens"] > 0 and sent["completion_tokens"] > 0
    wait_for(lambda: ledger_count(web_stack.db_engine, api_key_id=key_id) == 2, what="both calls in the ledger")

    # The key's last use is shown (written once a minute per key, off the request path)...
    wait_for(lambda: key_last_used(web_stack, key_id), what="the key's last use recorded")
    page.reload()
    expect(tid(page, f"key-last-used-{key_id}")).not_to_contain_text("never")

    # ... and the usage page shows exactly those tokens on top of what was there, in totals, chart and table.
    tid(page, "nav-usage").click()
    after = shown_usage(page)
    assert {k: after[k] - before[k] for k in sent} == sent
    chart = tid(page, "usage-chart").locator("canvas")
    label = chart.get_attribute("aria-label")
    assert f"{after['prompt_tokens']:,} tokens in, {after['completion_tokens']:,} tokens out, {after['requests']:,} requests" in label
    today = datetime.now(timezone.utc).date()
    page.get_by_text("Daily numbers as a table").click()
    day_row = tid(page, f"usage-day-{today.isoformat()}")
    expect(day_row).to_be_visible()
    cells = [c.strip().replace(",", "") for c in day_row.locator("td").all_inner_texts()]
    db_today = ledger_totals(web_stack.db_engine, today, today, web_stack.tenant_id)
    assert [int(cells[0]), int(cells[1]), int(cells[3])] == [db_today["requests"], db_today["prompt_tokens"],
                                                             db_today["completion_tokens"]]

    # The ledger holds exactly what the SDK was told.
    with web_stack.db_engine.connect() as conn:
        p, o = conn.execute(text("SELECT sum(prompt_tokens), sum(completion_tokens) FROM usage_events WHERE api_key_id = :k"),
                            {"k": key_id}).one()
    assert (p, o) == (sent["prompt_tokens"], sent["completion_tokens"])

    # Spend: what the ledger costs at the demo prices, the same on the spend card and the usage totals.
    month = ledger_totals(web_stack.db_engine, *month_of(today), web_stack.tenant_id)
    assert month["billed_microusd"] > 0
    expect(tid(page, "spend-total")).to_have_attribute("data-microusd", str(month["billed_microusd"]))
    assert micro_usd(page, "usage-total-billed") == month["billed_microusd"]
    assert tid(page, "spend-total").inner_text().startswith("$0.0")
    budget = tid(page, "budget-meter")
    expect(budget).to_contain_text(f"{month['prompt_tokens'] + month['completion_tokens']:,}")


@pytest.mark.parametrize("viewport", [PHONE], indirect=True, ids=["390px"])
def test_tenant_member_has_no_key_controls_and_the_api_refuses_them(page, web_stack):
    sign_in(page, "member@demo.test")
    expect(tid(page, "current-user-role")).to_contain_text("Tenant member")
    # The dashboard fits 390 px without sideways scrolling; an admin page is not found for a member.
    expect(tid(page, "spend-total")).to_be_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    page.goto("/admin/tenants")
    expect(tid(page, "not-found")).to_be_visible()

    tid(page, "nav-keys").click()
    expect(tid(page, "keys-readonly")).to_be_visible()
    expect(tid(page, "keys-table").or_(tid(page, "keys-empty"))).to_be_visible()
    for control in ("create-key", "create-key-name"):
        expect(tid(page, control)).to_have_count(0)
    expect(page.locator("[data-testid^='revoke-key-']")).to_have_count(0)

    # The server decides: the member's own signed-in session (cookie + CSRF token) is refused.
    r = page.context.request.post("/api/tenant/keys", data={"name": "sneaky"},
                                  headers={"X-CSRF-Token": csrf_token(page)})
    assert r.status == 403, r.text()
    err = r.json()["error"]
    assert err["type"] and err["message"]
    page.reload()
    expect(tid(page, "keys-readonly")).to_be_visible()
    expect(page.locator("[data-testid^='key-row-']", has_text="sneaky")).to_have_count(0)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
