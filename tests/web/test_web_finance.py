"""Finance in a real browser: picks a period, reads the per-tenant report, downloads the CSV; the CSV's totals
and rows match what the page shows and what the usage ledger in the database adds up to."""
from __future__ import annotations

import csv
import io
from datetime import datetime, timedelta, timezone

from openai import OpenAI
from playwright.sync_api import expect
from sqlalchemy.orm import Session

from tests.factories import make_api_key, make_tenant, unique
from tests.web.helpers import ledger_count, ledger_totals, micro_usd, sign_in, tid, wait_for

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "billed_microusd", "compute_cost_microusd")


def call(web_stack, key: str, n: int) -> None:
    client = OpenAI(base_url=f"{web_stack.url}/v1", api_key=key, max_retries=0)
    for i in range(n):
        client.chat.completions.create(model=web_stack.kit.model_name, max_tokens=4 + i, temperature=0,
                                       messages=[{"role": "user", "content": f"Sort: pear apple fig {i}"}])


def test_finance_downloads_the_csv_and_its_totals_match_the_page_and_the_ledger(page, web_stack, tmp_path):
    # Traffic from two tenants: the demo tenant and a second one.
    with Session(web_stack.db_engine, expire_on_commit=False) as s:
        other = make_tenant(s, name=f"Acme {unique('fin')}")
        other_key = make_api_key(s, tenant=other)
    demo_before = ledger_count(web_stack.db_engine, tenant_id=web_stack.tenant_id)
    call(web_stack, web_stack.api_key, 2)
    call(web_stack, other_key.secret, 1)
    wait_for(lambda: ledger_count(web_stack.db_engine, tenant_id=other.id) == 1
             and ledger_count(web_stack.db_engine, tenant_id=web_stack.tenant_id) == demo_before + 2,
             what="all three calls in the ledger")

    sign_in(page, "finance@multiplex.test")
    expect(page).to_have_url(f"{web_stack.url}/finance")
    expect(tid(page, "nav-finance")).to_be_visible()
    expect(tid(page, "nav-tenants")).to_have_count(0)

    # Pick a period: the last 7 days up to today (UTC).
    today = datetime.now(timezone.utc).date()
    first = today - timedelta(days=6)
    tid(page, "period-from").fill(first.isoformat())
    tid(page, "period-to").fill(today.isoformat())
    tid(page, "period-apply").click()
    expect(tid(page, "finance-period")).to_contain_text(f"{first.isoformat()} to {today.isoformat()}")
    expect(tid(page, "finance-totals-mismatch")).to_have_count(0)

    db = ledger_totals(web_stack.db_engine, first, today)
    assert db["requests"] >= 3 and db["billed_microusd"] > 0
    page_totals = {"billed": micro_usd(page, "finance-total-billed"), "cost": micro_usd(page, "finance-total-cost"),
                   "margin": micro_usd(page, "finance-total-margin")}
    foot = [c.replace(",", "") for c in tid(page, "finance-totals").locator("td").all_inner_texts()]
    assert [int(x) for x in foot[:4]] == [db["requests"], db["prompt_tokens"], db["cached_tokens"], db["completion_tokens"]]
    assert page_totals == {"billed": db["billed_microusd"], "cost": db["compute_cost_microusd"],
                           "margin": db["billed_microusd"] - db["compute_cost_microusd"]}

    # Per tenant, on the page and in the ledger.
    for tenant_id in (web_stack.tenant_id, other.id):
        cells = [c.replace(",", "") for c in tid(page, f"finance-row-{tenant_id}").locator("td").all_inner_texts()]
        t = ledger_totals(web_stack.db_engine, first, today, tenant_id)
        assert [int(x) for x in cells[:4]] == [t["requests"], t["prompt_tokens"], t["cached_tokens"], t["completion_tokens"]]

    # The table sorts: by tenant name A→Z, then Z→A.
    tid(page, "sort-tenant").click()
    names = page.locator("[data-testid^='finance-row-'] th").all_inner_texts()
    assert names == sorted(names, key=str.casefold) and len(names) >= 2
    tid(page, "sort-tenant").click()
    assert page.locator("[data-testid^='finance-row-'] th").all_inner_texts() == names[::-1]

    # Download the CSV for the picked period.
    link = tid(page, "download-csv")
    expect(link).to_have_attribute("href", f"/api/finance/report.csv?from={first.isoformat()}&to={today.isoformat()}")
    with page.expect_download() as download:
        link.click()
    d = download.value
    assert d.suggested_filename == f"mplex-cost-report_{first.isoformat()}_{today.isoformat()}.csv"
    path = tmp_path / d.suggested_filename
    d.save_as(path)
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    total = next(r for r in rows if r["level"] == "total")
    assert {f: int(total[f]) for f in FIELDS} == {f: db[f] for f in FIELDS}
    assert int(total["margin_microusd"]) == page_totals["margin"]
    assert (total["period_from"], total["period_to"]) == (first.isoformat(), today.isoformat())
    tenants = {r["tenant_id"]: r for r in rows if r["level"] == "tenant"}
    assert set(tenants) == {r.get_attribute("data-testid").removeprefix("finance-row-")
                            for r in page.locator("[data-testid^='finance-row-']").all()}
    for tenant_id in (web_stack.tenant_id, other.id):
        t = ledger_totals(web_stack.db_engine, first, today, tenant_id)
        assert {f: int(tenants[str(tenant_id)][f]) for f in FIELDS} == {f: t[f] for f in FIELDS}
    assert sum(int(r["billed_microusd"]) for r in tenants.values()) == int(total["billed_microusd"])
