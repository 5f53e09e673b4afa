"""Platform-admin pages of issue 26 in real Chromium at 1440 px and 390 px, against the real stack: the adapters
table (one row each, search, status filter, pages, rejected collapsed), the version page (rollback target picked
from the versions, active one marked, eval examples side by side, delete apart and confirmed), not-found version
pages, the upload form's status and error lines, tenants (users, spend, search, formatted limits) and engines
(adapters by name and tenant, health, history). Each of the issue's bugs has its regression check here, marked
"Bug (n)"; bug 6 (the period chip) is in test_web_tenant_views.py."""
from __future__ import annotations

import json
import re
import time
import uuid
from datetime import datetime, timezone

import pytest
from openai import OpenAI
from playwright.sync_api import expect
from sqlalchemy import text
from sqlalchemy.orm import Session

from tests.web.helpers import (
    WIDTH_IDS,
    WIDTHS,
    expected_http_error,
    ledger_totals,
    shot,
    sign_in,
    tid,
    visit,
    wait_for,
)
from tests.web.test_web_admin import pickle_archive
from tests.web.test_web_tenant import month_of

EXAMPLES = [
    {"prompt": f"Summarize: item {i}", "expected": f"summary {i}", "base": f"base says {i}", "adapter": f"summary {i}",
     "full_precision": f"summary {i}", "base_score": 0.25, "adapter_score": 1.0}
    for i in range(3)
]
# A gate run without a task eval set, as services/adapters/checks.py reports it: every check, passed ones too.
GATE = {"passed": True,
        "metrics": {"check": "no_regression", "adapter": {"rouge_l": 0.97}, "base": {"rouge_l": 0.98},
                    "full_precision": {"rouge_l": 0.97}, "fp8_token_agreement": 1.0, "n_examples": 3,
                    "regression": {"n": 3, "mean_drop": 0.01, "upper_bound": 0.02, "confidence": 0.95, "worse": 1,
                                   "better": 0, "tied": 2},
                    "malformed": {"count": 0, "rate": 0.0}, "degenerate_logits": {"tokens": 0, "checked": 30, "outputs": 0}},
        "thresholds": {"metric": "rouge_l", "min_margin": 0.05, "min_fp8_agreement": 0.9, "max_regression": 0.05},
        "reasons": [
            {"check": "no_regression", "code": "no_regression_ok", "passed": True, "value": 0.02, "threshold": 0.05,
             "message": "rouge_l on 3 base-capability items: within the tolerance"},
            {"check": "well_formed", "code": "well_formed_ok", "passed": True, "value": 0.0, "threshold": 0.02,
             "message": "0 of 3 outputs malformed"},
            {"check": "logits", "code": "logits_ok", "passed": True, "value": 0.0, "threshold": 0.0,
             "message": "finite, informative logits on all 30 generated tokens"},
            {"check": "fp8_agreement", "code": "fp8_agreement_ok", "passed": True, "value": 1.0, "threshold": 0.9,
             "message": "not applicable: engines serve the base in full precision"}],
        "examples": EXAMPLES}


def new_tenant(web_stack, label: str):
    from tests.factories import make_base_model, make_tenant

    with Session(web_stack.db_engine, expire_on_commit=False) as s:
        make_base_model(s, name=web_stack.kit.model_name)
        return make_tenant(s, name=f"{label} {uuid.uuid4().hex[:6]}")


def add_adapter(web_stack, tenant, name: str, *statuses: str, active: int | None = None, gate: dict | None = None):
    """An adapter with one version per status (v1, v2, ...), `active` the routable one. Rows only: no files."""
    from services.common.models import AdapterStatus
    from tests.factories import make_adapter, make_adapter_version

    with Session(web_stack.db_engine, expire_on_commit=False) as s:
        from services.common.models import BaseModelRecord
        from sqlalchemy import select

        base = s.scalar(select(BaseModelRecord).where(BaseModelRecord.name == web_stack.kit.model_name))
        adapter = make_adapter(s, tenant=tenant, name=name, base_model=base)
        versions = []
        for i, status in enumerate(statuses, 1):
            v = make_adapter_version(s, adapter=adapter, status=AdapterStatus(status), rank=8, activate=i == active)
            if gate is not None and status != "uploaded":
                v.eval_summary = gate
            if status == "rejected":
                v.status_reasons = [{"code": "margin_below_threshold", "message": "adapter does not beat the base model"}]
            versions.append(v)
        s.commit()
        return adapter, versions


@pytest.fixture(scope="module")
def catalog(web_stack):
    """47 adapters, as in the issue: 22 routable (two with a version being evaluated), 3 brand new, 22 rejected."""
    tenant = new_tenant(web_stack, "Catalog")
    for i in range(22):
        add_adapter(web_stack, tenant, f"svc-{i:02d}", "ready", *(["evaluating"] if i in (3, 7) else []), active=1)
    for i in range(3):
        add_adapter(web_stack, tenant, f"new-{i}", "validating")
    for i in range(22):
        add_adapter(web_stack, tenant, f"test-upload-{i:02d}", "rejected", "rejected")
    return tenant


def rows(page) -> list[str]:
    return [t.get_attribute("data-testid").removeprefix("adapter-toggle-")
            for t in page.locator("[data-testid^='adapter-toggle-']").all()]


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_adapters_are_one_row_each_with_search_status_pages_and_rejected_collapsed(page, web_stack, catalog, viewport):
    sign_in(page, "platform@multiplex.test")
    page.goto(f"/admin/tenants/{catalog.id}/adapters")
    expect(tid(page, "adapters-count")).to_have_text("47 of 47 adapters · 22 rejected collapsed")
    size = 20 if viewport["width"] >= 1000 else 10  # fewer of the taller phone cards per page
    live = [f"svc-{i:02d}" for i in range(22)] + ["new-0", "new-1", "new-2"]
    # Routable adapters first (by name), then the new ones; the rejected test uploads are out of the way.
    assert rows(page) == live[:size]
    pages = -(-25 // size)
    expect(tid(page, "adapters-pager-status")).to_have_text(f"1–{size} of 25 adapters · page 1 of {pages}")
    expect(tid(page, "adapter-active-svc-00")).to_contain_text("v1")
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height < (2200 if size == 20 else 3600), height  # not 7,500 px of cards
    visit(page, "adapters-table")
    for _ in range(pages - 1):
        tid(page, "adapters-pager-next").click()
    assert rows(page) == live[(pages - 1) * size:]
    expect(tid(page, "adapters-pager-next")).to_be_disabled()

    # Search by name (a search finds rejected ones too), and filter by status.
    tid(page, "adapters-search").fill("svc-1")
    assert rows(page) == [f"svc-{i}" for i in range(10, 20)][:size]
    tid(page, "adapters-search").fill("upload-05")
    assert rows(page) == ["test-upload-05"]
    tid(page, "adapters-search").fill("")
    tid(page, "adapters-status").select_option("in_progress")
    assert rows(page) == ["svc-03", "svc-07", "new-0", "new-1", "new-2"]
    tid(page, "adapters-status").select_option("rejected")
    assert rows(page) == [f"test-upload-{i:02d}" for i in range(size)]
    expect(tid(page, "adapters-pager-status")).to_contain_text("of 22 adapters")
    tid(page, "adapters-status").select_option("all")

    # The collapsed rejected adapters open on request, after the others.
    tid(page, "adapters-show-rejected").click()
    expect(tid(page, "adapters-pager-status")).to_have_text(f"1–{size} of 47 adapters · page 1 of {-(-47 // size)}")
    for _ in range(-(-47 // size) - 1):
        tid(page, "adapters-pager-next").click()
    assert rows(page)[-1] == "test-upload-21"
    tid(page, "adapters-show-rejected").click()
    expect(tid(page, "adapters-count")).to_contain_text("22 rejected collapsed")

    # A row opens its versions; a version its details.
    tid(page, "adapter-toggle-svc-03").click()
    group = tid(page, "adapter-svc-03")
    expect(group.locator("[data-testid^='version-row-']")).to_have_count(2)
    group.locator("[data-testid^='version-toggle-']").first.click()  # newest first: v2, evaluating
    expect(group.get_by_test_id("version-status")).to_have_text("evaluating")
    visit(page, "adapters-row-open")


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_version_page_picks_the_active_version_shows_examples_side_by_side_and_deletes_apart(page, web_stack, viewport):
    tenant = new_tenant(web_stack, "Versions")
    adapter, (v1, v2, v3) = add_adapter(web_stack, tenant, "summarizer", "ready", "ready", "rejected", active=2, gate=GATE)
    sign_in(page, "platform@multiplex.test")
    page.goto(f"/admin/versions/{v2.id}")
    expect(tid(page, "version-status")).to_have_text("ready")
    expect(tid(page, "version-active")).to_contain_text("Calls to summarizer use this version")
    # Bug (4): the way back names where it goes: this tenant's adapters, not "Back to uploads".
    expect(tid(page, "version-back")).to_have_text(f"← Adapters of {tenant.name}")
    expect(tid(page, "version-back")).to_have_attribute("href", f"/admin/tenants/{tenant.id}/adapters")

    # The rollback target is picked from the versions: the active one marked, a rejected one not pickable.
    form = tid(page, "rollback-form")
    expect(tid(page, "rollback-active-2")).to_be_visible()
    expect(tid(page, "rollback-version-2")).to_be_checked()
    expect(tid(page, "rollback-version-3")).to_be_disabled()
    expect(tid(page, "rollback-submit")).to_be_disabled()
    # Delete lives apart from the routine controls.
    expect(form.get_by_test_id("delete-adapter")).to_have_count(0)
    expect(tid(page, "danger-zone").get_by_test_id("delete-adapter")).to_be_visible()
    visit(page, "version-page")

    tid(page, "rollback-version-1").check()
    expect(tid(page, "rollback-submit")).to_have_text("Make v1 active")
    tid(page, "rollback-submit").click()
    expect(tid(page, "rollback-status")).to_have_text("Calls to summarizer now use v1.")
    # Bug (3), second half: the page of v2 now says it is no longer active, and v1 is marked.
    expect(tid(page, "version-active")).to_contain_text("Not active: calls to summarizer use v1")
    expect(tid(page, "rollback-active-1")).to_be_visible()
    with Session(web_stack.db_engine) as s:
        active = s.execute(text("SELECT active_version_id FROM adapters WHERE id = :a"), {"a": adapter.id}).scalar_one()
    assert active == v1.id

    # Bug (3), first half: a refused rollback shows its error alone, not next to the last success message.
    with Session(web_stack.db_engine) as s:  # v2 is rejected behind the page's back
        s.execute(text("UPDATE adapter_versions SET status = 'rejected' WHERE id = :v"), {"v": v2.id})
        s.commit()
    tid(page, "rollback-version-2").check()
    tid(page, "rollback-submit").click()
    expect(tid(page, "adapter-action-error")).to_contain_text("only a ready version can be active")
    expect(tid(page, "rollback-status")).to_have_text("")
    expected_http_error(page, 409, "/rollback")
    shot(page, "version-page-refused-rollback")

    # Every check the gate made, with its verdict and its own words; no margin row it never applied.
    page.goto(f"/admin/versions/{v1.id}")
    expect(tid(page, "version-active")).to_contain_text("use this version")
    checks = [c.get_attribute("data-testid") for c in page.locator("[data-testid^='gate-check-']").all()]
    assert checks == ["gate-check-no_regression", "gate-check-well_formed", "gate-check-logits", "gate-check-fp8_agreement"]
    expect(tid(page, "gate-check-no_regression")).to_contain_text("within the tolerance")
    expect(tid(page, "gate-check-no_regression")).to_contain_text("≤ +0.05")
    expect(tid(page, "gate-facts")).to_contain_text("no regression")

    # Eval examples side by side: prompt | expected | base | adapter.
    tid(page, "gate-examples-toggle").click()
    table = tid(page, "gate-examples")
    assert [h.strip() for h in table.locator("thead th").all_text_contents()] == ["Prompt", "Expected", "Base model", "Adapter"]
    cells = tid(page, "gate-example-1").locator("td pre").all_inner_texts()
    assert cells == ["Summarize: item 1", "summary 1", "base says 1", "summary 1"]
    row_box = tid(page, "gate-example-1").bounding_box()
    if viewport["width"] >= 1000:  # four columns in one row, each one a quarter, not 300 px stacks
        tops = {round(c.bounding_box()["y"]) for c in tid(page, "gate-example-1").locator("td").all()}
        assert len(tops) == 1 and row_box["height"] < 120
    else:  # a card per example on a phone
        assert tid(page, "gate-example-1").evaluate("e => getComputedStyle(e).display") == "block"
    visit(page, "version-examples")

    # Bug (4): delete asks first (the name, typed), then lands on the tenant's adapters saying what happened.
    tid(page, "delete-adapter").click()
    expect(tid(page, "confirm-delete-adapter")).to_be_disabled()
    tid(page, "delete-confirm-name").fill("summarize")
    expect(tid(page, "confirm-delete-adapter")).to_be_disabled()
    tid(page, "delete-confirm-name").fill("summarizer")
    shot(page, "version-delete-confirm")
    tid(page, "confirm-delete-adapter").click()
    expect(page).to_have_url(f"{web_stack.url}/admin/tenants/{tenant.id}/adapters")
    expect(tid(page, "adapters-notice")).to_contain_text("“summarizer” was deleted")
    expect(tid(page, "adapters-empty")).to_be_visible()
    visit(page, "adapters-after-delete")
    page.reload()  # the notice is shown once
    expect(tid(page, "adapters-empty")).to_be_visible()
    expect(tid(page, "adapters-notice")).to_have_count(0)


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_bad_and_unknown_version_ids_get_a_not_found_page(page, web_stack, viewport):
    # Bug (5): no raw validation text for a malformed id, no "Something went wrong" + "Try again" for an unknown one.
    for email, base in (("admin@demo.test", "/adapters/versions"), ("platform@multiplex.test", "/admin/versions")):
        sign_in(page, email)
        page.goto(f"{base}/not-a-uuid")
        expect(tid(page, "version-invalid")).to_contain_text("“not-a-uuid” is not a version id")
        expect(page.get_by_text("Try again")).to_have_count(0)
        expect(page.get_by_text("uuid_parsing")).to_have_count(0)
        visit(page, f"version-invalid-{email.split('@')[0]}")
        page.goto(f"{base}/{uuid.uuid4()}")
        expect(tid(page, "version-not-found")).to_contain_text("No adapter version has this id")
        expect(page.get_by_text("Something went wrong")).to_have_count(0)
        expect(page.get_by_text("Try again")).to_have_count(0)
        visit(page, f"version-unknown-{email.split('@')[0]}")
        expected_http_error(page, 404, r"adapter-versions/[0-9a-f-]{36}")
        # ...and it is not asked again: a poll a second later (POLL_MS) would log the same 404 once more.
        page.wait_for_timeout(2500)
        assert not page.problems, f"the missing version was fetched again: {page.problems}"
        tid(page, "sign-out").click()
        expect(tid(page, "login-form")).to_be_visible()


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_upload_status_follows_the_version_and_an_old_error_clears(page, web_stack, viewport, tmp_path):
    sign_in(page, "platform@multiplex.test")
    tid(page, "nav-upload").click()
    tid(page, "upload-tenant").select_option(str(web_stack.tenant_id))
    if viewport["width"] >= 1000:
        # A demo adapter that passes the gate; first with a broken eval set, which the server refuses at once.
        adapter = web_stack.kit.adapters["uppercase"]
        tid(page, "upload-name").fill(f"upper-{uuid.uuid4().hex[:6]}")
        tid(page, "upload-mode-files").check()
        tid(page, "upload-file").set_input_files([adapter.path / "adapter_config.json", adapter.path / "adapter_model.safetensors"])
        page.get_by_text("Quality gate options").click()
        broken = tmp_path / "eval.jsonl"
        broken.write_text("this is not json\n")
        tid(page, "upload-eval-set").set_input_files(broken)
        tid(page, "upload-submit").click()
        expect(tid(page, "upload-error")).to_contain_text("eval_set")
        expected_http_error(page, 400, f"/api/admin/tenants/{web_stack.tenant_id}/adapters")
        # Bug (2): fixing the input clears the old error; the valid retry shows none.
        tid(page, "upload-eval-set").set_input_files(adapter.eval_path)
        expect(tid(page, "upload-error")).to_have_count(0)
        tid(page, "upload-submit").click()
        expect(tid(page, "upload-progress")).to_have_attribute("data-phase", "done", timeout=60_000)
        expect(tid(page, "upload-error")).to_have_count(0)
        final = "ready"
    else:
        # A pickled archive: accepted, then rejected by validation; first without a file, refused in the browser.
        archive = tmp_path / "pickled.tar.gz"
        archive.write_bytes(pickle_archive())
        tid(page, "upload-name").fill(f"pickled-{uuid.uuid4().hex[:6]}")
        tid(page, "upload-submit").click()
        expect(tid(page, "upload-error")).to_contain_text("Choose one .tar.gz or .zip archive")
        # Bug (2): choosing the file clears the old error; the valid retry shows none.
        tid(page, "upload-file").set_input_files(archive)
        expect(tid(page, "upload-error")).to_have_count(0)
        tid(page, "upload-submit").click()
        expect(tid(page, "upload-progress")).to_have_attribute("data-phase", "done", timeout=60_000)
        expect(tid(page, "upload-error")).to_have_count(0)
        final = "rejected"
    expect(tid(page, "version-status")).to_have_text(final, timeout=180_000)
    # Bug (1): the status line says what the version became, not "validation has started".
    expect(tid(page, "upload-status")).to_contain_text(final)
    expect(tid(page, "upload-status")).not_to_contain_text("validation has started")
    visit(page, f"upload-{final}")


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_tenants_list_users_spend_search_and_formatted_limits(page, web_stack, viewport):
    client = OpenAI(base_url=f"{web_stack.url}/v1", api_key=web_stack.api_key, max_retries=0)
    client.chat.completions.create(model=web_stack.kit.model_name, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    sign_in(page, "platform@multiplex.test")
    expect(tid(page, "tenant-row-demo")).to_be_visible()
    today = datetime.now(timezone.utc).date()
    billed = wait_for(lambda: ledger_totals(web_stack.db_engine, *month_of(today), web_stack.tenant_id)["billed_microusd"],
                      what="demo usage billed")
    page.reload()
    expect(tid(page, "tenant-billed-demo")).to_have_attribute("data-microusd", str(billed))

    # Search by name or slug.
    total = page.locator("[data-testid^='tenant-row-']").count()
    tid(page, "tenants-search").fill("demo")
    expect(page.locator("[data-testid^='tenant-row-']")).to_have_count(1)
    expect(tid(page, "tenants-count")).to_have_text(f"1 of {total} tenants")

    # The tenant's users.
    tid(page, "tenant-users-demo").click()
    panel = tid(page, "tenant-users-panel")
    expect(panel.get_by_test_id("tenant-user-admin@demo.test")).to_contain_text("admin")
    expect(panel.get_by_test_id("tenant-user-member@demo.test")).to_contain_text("member")
    visit(page, "tenants-users")

    # Limits read with thousands separators, in the edit form and as typed in the create form.
    tid(page, "tenant-edit-demo").click()
    expect(tid(page, "edit-limit-tokens-per-min")).to_have_value("200,000")
    tid(page, "tenant-edit-demo").click()
    tid(page, "create-tenant-open").click()
    field = tid(page, "tenant-limit-monthly-tokens")
    field.fill("2500000")
    field.press("Tab")
    expect(field).to_have_value("2,500,000")
    name = f"Formatted {uuid.uuid4().hex[:6]}"
    tid(page, "tenant-name").fill(name)
    tid(page, "tenant-plan").fill("pro")
    tid(page, "create-tenant").click()
    expect(tid(page, "tenants-status")).to_contain_text(f"Tenant {name} created")
    with Session(web_stack.db_engine) as s:
        budget = s.execute(text("SELECT l.monthly_token_budget FROM tenant_limits l JOIN tenants t ON t.id = l.tenant_id "
                                "WHERE t.name = :n"), {"n": name}).scalar_one()
    assert budget == 2_500_000
    visit(page, "tenants-created")


@pytest.fixture
def fake_engine(web_stack, service_urls):
    """A second registry entry as an engine publishes it, serving another base model (so nothing is routed to it),
    holding an adapter version of a tenant by content hash, with its KV cache nearly full."""
    import redis

    from services.common.engine_registry import REGISTRY_SET, entry_key, history_key

    tenant = new_tenant(web_stack, "Engines")
    _, (v1,) = add_adapter(web_stack, tenant, "router-bot", "ready", active=1)
    engine_id = f"fake-eng-{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(service_urls.redis_url)
    now = time.time()
    snap = {"id": engine_id, "url": "http://10.9.9.9:9000", "base_model": "another-model", "running": 2, "waiting": 0,
            "kv_usage": 0.97, "max_num_seqs": 8, "slots_total": 4, "tokens_total": 500, "ts": now,
            "slot_adapters": [v1.content_sha256], "host_adapters": [v1.content_sha256]}
    def beat() -> None:  # the real engines refresh their entries every second; so does this one while it lasts
        client.set(entry_key(engine_id), json.dumps({**snap, "ts": time.time()}), ex=5)

    beat()
    client.sadd(REGISTRY_SET, engine_id)
    client.lpush(history_key(engine_id), *[json.dumps({"ts": now - 10 + 5 * i, "tokens": 100 * i, "running": i, "waiting": 0,
                                                       "kv_usage": 0.9, "slots_used": 1, "slots_total": 4}) for i in range(3)])
    yield engine_id, tenant, v1, beat
    client.delete(entry_key(engine_id), history_key(engine_id))
    client.srem(REGISTRY_SET, engine_id)
    client.close()


@pytest.mark.parametrize("viewport", WIDTHS, indirect=True, ids=WIDTH_IDS)
def test_engines_show_adapters_by_name_health_and_history(page, web_stack, viewport, fake_engine):
    engine_id, tenant, v1, beat = fake_engine
    # Traffic on the real engine, so its history has some throughput.
    client = OpenAI(base_url=f"{web_stack.url}/v1", api_key=web_stack.api_key, max_retries=0)
    for i in range(3):
        client.chat.completions.create(model=web_stack.kit.model_name, max_tokens=12, temperature=0,
                                       messages=[{"role": "user", "content": f"Sort: pear apple fig {i}"}])
    sign_in(page, "platform@multiplex.test")
    beat()
    tid(page, "nav-engines").click()
    row = tid(page, f"engine-row-{engine_id}")
    expect(row).to_be_visible()
    # Adapters by name@version and tenant; the hash only on hover.
    expect(tid(page, f"engine-slots-{engine_id}")).to_contain_text(f"router-bot@1 · {tenant.name}")
    expect(tid(page, f"engine-slots-{engine_id}")).to_contain_text("1 of 4 slots")
    assert v1.content_sha256 not in row.inner_text() and not re.search(r"[0-9a-f]{40}", row.inner_text())
    # Health: the fake engine's KV cache is nearly full; the real one is healthy.
    expect(tid(page, f"engine-health-{engine_id}")).to_contain_text("degraded")
    expect(tid(page, f"engine-health-{engine_id}")).to_contain_text("KV cache 97% full")
    real_rows = [r for r in page.locator("[data-testid^='engine-row-']").all() if engine_id not in r.get_attribute("data-testid")]
    real_id = real_rows[0].get_attribute("data-testid").removeprefix("engine-row-")
    expect(tid(page, f"engine-health-{real_id}")).to_contain_text("healthy")

    # The last minutes: a chart per metric, and the numbers beside them; the real engine processed tokens.
    for metric in ("throughput", "queue", "kv", "slots"):
        expect(tid(page, f"engine-history-{metric}").locator("canvas")).to_have_attribute("aria-label", re.compile(real_id))
    peak = lambda: tid(page, f"engine-history-row-{real_id}").locator("td").first.inner_text()  # noqa: E731
    deadline = time.monotonic() + 30
    while re.search(r"/ 0 tokens/s$", peak()) and time.monotonic() < deadline:
        beat()
        tid(page, "engines-refresh").click()
        page.wait_for_timeout(1000)
    assert not re.search(r"/ 0 tokens/s$", peak()), peak()
    expect(tid(page, f"engine-history-row-{engine_id}")).to_contain_text("20 tokens/s")  # 100 tokens per 5 s
    beat()
    visit(page, "engines")

