"""Finance of issue 26 in real Chromium at 1440 px and 390 px: the margin after idle GPU cost next to the gross
margin (agreeing with the report API to the micro-dollar), the trend per day, one fixed number of decimals per
money column, the period in the URL, and the per-tenant table as cards on a phone with its sort controls."""
from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest
from openai import OpenAI
from playwright.sync_api import expect
from sqlalchemy import text

from tests.web.helpers import WIDTH_IDS, WIDTHS, ledger_count, micro_usd, sign_in, tid, visit, wait_for


@pytest.fixture(scope="module")
def idle_day(web_stack):
    """Today's traffic and an hour of idle engine time today (the demo "cpu" engine type is priced per hour)."""
    before = ledger_count(web_stack.db_engine, tenant_id=web_stack.tenant_id)
    OpenAI(base_url=f"{web_stack.url}/v1", api_key=web_stack.api_key, max_retries=0).chat.completions.create(
        model=web_stack.kit.model_name, max_tokens=6, messages=[{"role": "user", "content": "Sort: fig pear"}])
    wait_for(lambda: ledger_count(web_stack.db_engine, tenant_id=web_stack.tenant_id) > before, what="the call in the ledger")
    start = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(minutes=1)
    with web_stack.db_engine.begin() as conn:
        conn.execute(text("INSERT INTO engine_usage_reports (engine_id, engine_type, base_model, window_start, window_end, "
                          "busy_us, idle_us) VALUES ('idle-web-test', 'cpu', :m, :s, :e, 0, 3600000000) "
                          "ON CONFLICT DO NOTHING"), {"m": web_stack.kit.model_name, "s": start, "e": start + timedelta(hours=1)})
    return start.date()


def decimals(texts: list[str]) -> set[int]:
    return {len(m.group(1)) for t in texts if (m := re.search(r"\.(\d+)$", t.strip()))}


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_finance_shows_net_margin_after_idle_cost_a_trend_and_fixed_decimals(page, web_stack, idle_day, viewport):
    sign_in(page, "finance@multiplex.test")
    tid(page, "period-last-7").click()
    expect(page).to_have_url(re.compile(r"/finance\?from=[\d-]+&to=[\d-]+$"))
    period = dict(re.findall(r"(from|to)=([\d-]+)", page.url))
    report = page.context.request.get("/api/finance/report", params=period).json()
    expect(tid(page, "finance-net-margin")).to_have_attribute("data-microusd", str(report["net_margin_microusd"]))

    # Net margin = gross margin - the idle cost no tenant used; an hour of idle CPU (0.40 $) outweighs the demo bills.
    billed, cost, margin = (micro_usd(page, t) for t in ("finance-total-billed", "finance-total-cost", "finance-total-margin"))
    idle, net = micro_usd(page, "finance-unallocated"), micro_usd(page, "finance-net-margin")
    assert idle >= 400_000 and margin == billed - cost and net == margin - idle < 0
    expect(tid(page, "finance-net-margin")).to_have_class(re.compile("negative"))
    expect(tid(page, "finance-net-negative")).to_be_visible()

    # The trend per day: chart and table, today's row the same as a report for today alone.
    expect(tid(page, "finance-trend-chart").locator("canvas")).to_have_attribute("aria-label", re.compile(r"net margin -?\$"))
    tid(page, "finance-trend-toggle").click()
    day = idle_day.isoformat()
    today = page.context.request.get("/api/finance/report", params={"from": day, "to": day}).json()
    row = tid(page, f"finance-trend-{day}")
    expect(row.locator("td[data-label='Billed']")).to_have_attribute("data-microusd", str(today["totals"]["billed_microusd"]))
    expect(row.locator("td[data-label='Idle cost']")).to_have_attribute("data-microusd", str(today["unallocated_cost_microusd"]))
    expect(row.locator("td[data-label='Net margin']")).to_have_attribute("data-microusd", str(today["net_margin_microusd"]))

    # Each money column prints one number of decimals, totals included.
    for label in ("Billed", "Attributed cost", "Margin"):
        cells = page.locator(f"[data-testid='finance-table'] td[data-label='{label}']").all_inner_texts()
        assert len(cells) >= 2 and len(decimals(cells)) == 1, (label, cells)

    # A phone: each tenant is a card, the sort controls stay usable, nothing scrolls sideways.
    first = page.locator("[data-testid^='finance-row-']").first
    if viewport["width"] < 700:
        assert first.evaluate("e => getComputedStyle(e).display") == "block"
        tid(page, "sort-tenant").click()
        names = page.locator("[data-testid^='finance-row-'] th").all_inner_texts()
        assert names == sorted(names, key=str.casefold)
    else:
        assert first.evaluate("e => getComputedStyle(e).display") == "table-row"
    visit(page, "finance")

    # The period survives a reload.
    page.reload()
    expect(tid(page, "period-from")).to_have_value(period["from"])
    expect(tid(page, "finance-period")).to_contain_text(f"{period['from']} to {period['to']}")
