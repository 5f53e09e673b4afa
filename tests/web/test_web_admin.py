"""Platform admin in a real browser: uploads a trained demo adapter for the demo tenant, watches the transfer's
progress bar and the version's status live until `ready`, reads the gate's metrics; a pickled upload is
rejected and the page says why."""
from __future__ import annotations

import io
import json
import pickle
import tarfile
import uuid

from playwright.sync_api import expect
from sqlalchemy import text

from tests.web.helpers import sign_in, tid

ADAPTER = "uppercase"  # the demo kit's r8 adapter: small, and far better than the base on its own eval set

# Records what the admin would have seen: every value/phase of the transfer bar and every version status.
WATCH = """() => {
  window.__seen = {progress: [], status: []};
  const look = () => {
    const bar = document.querySelector('[data-testid="upload-progress"]');
    if (bar) {
      const p = [bar.getAttribute('data-phase'), bar.hasAttribute('value') ? Number(bar.value) : null];
      const last = window.__seen.progress.at(-1);
      if (!last || last[0] !== p[0] || last[1] !== p[1]) window.__seen.progress.push(p);
    }
    const st = document.querySelector('[data-testid="version-status"]');
    if (st && window.__seen.status.at(-1) !== st.textContent) window.__seen.status.push(st.textContent);
  };
  new MutationObserver(look).observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
}"""


def open_upload_form(page, web_stack, name: str) -> None:
    sign_in(page, "platform@multiplex.test")
    expect(tid(page, "current-user-role")).to_contain_text("Platform admin")
    tid(page, "nav-upload").click()
    tid(page, "upload-tenant").select_option(str(web_stack.tenant_id))
    tid(page, "upload-name").fill(name)


def db_version(web_stack, name: str) -> dict:
    with web_stack.db_engine.connect() as conn:
        row = conn.execute(text("SELECT v.id, v.status, a.tenant_id FROM adapter_versions v JOIN adapters a ON a.id = v.adapter_id "
                                "WHERE a.name = :n"), {"n": name}).one()
    return {"id": str(row.id), "status": str(row.status), "tenant_id": row.tenant_id}


def test_admin_uploads_a_demo_adapter_and_watches_it_become_ready(page, web_stack):
    adapter = web_stack.kit.adapters[ADAPTER]
    name = f"{ADAPTER}-{uuid.uuid4().hex[:6]}"
    open_upload_form(page, web_stack, name)
    tid(page, "upload-mode-files").check()
    tid(page, "upload-file").set_input_files([adapter.path / "adapter_config.json", adapter.path / "adapter_model.safetensors"])
    expect(tid(page, "upload-selected")).to_contain_text("adapter_model.safetensors")
    page.get_by_text("Quality gate options").click()
    tid(page, "upload-eval-set").set_input_files(adapter.eval_path)

    # A slow uplink, so the transfer takes about three seconds and the bar has something to show.
    size = sum(f.stat().st_size for f in adapter.path.iterdir()) + adapter.eval_path.stat().st_size
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": -1,
                                                  "uploadThroughput": max(16 * 1024, size // 3)})
    page.evaluate(WATCH)
    tid(page, "upload-submit").click()
    expect(tid(page, "upload-progress")).to_have_attribute("data-phase", "done", timeout=60_000)
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    expect(tid(page, "upload-progress")).to_have_attribute("value", "100")
    expect(tid(page, "upload-percent")).to_contain_text("100%")
    expect(tid(page, "upload-status")).to_contain_text("Upload complete")

    # Live status until the gate decides.
    expect(tid(page, "version-status")).to_have_text("ready", timeout=180_000)
    seen = page.evaluate("window.__seen")
    sending = [v for phase, v in seen["progress"] if phase == "sending" and v is not None]
    assert any(0 < v < 100 for v in sending), f"the bar never showed partial progress: {seen['progress']}"
    assert sending == sorted(sending), seen["progress"]
    assert seen["status"][-1] == "ready" and set(seen["status"]) <= {"uploaded", "validating", "evaluating", "ready"}
    assert len(seen["status"]) >= 2, f"no status change was shown before ready: {seen['status']}"

    # The gate's metrics: every check it made passed (the margin applies: an eval set came with the upload), scores
    # of adapter vs base per metric, the adapter's shape.
    expect(tid(page, "gate-passed")).to_have_text("passed")
    checks = [c.get_attribute("data-testid").removeprefix("gate-check-") for c in page.locator("[data-testid^='gate-check-']").all()]
    assert checks == ["margin", "well_formed", "logits", "fp8_agreement"], checks
    for check in checks:
        expect(tid(page, f"gate-check-{check}")).to_contain_text("passed")
    rouge = [c.strip() for c in tid(page, "gate-metric-rouge_l").locator("td").all_inner_texts()]
    base, adapter_score, delta = float(rouge[0]), float(rouge[1]), float(rouge[3])
    assert adapter_score > base and abs(delta - (adapter_score - base)) < 1e-3
    expect(tid(page, "gate-facts")).to_contain_text("eval set uploaded with this version")
    expect(tid(page, "version-details")).to_contain_text(", ".join(adapter.target_modules))
    expect(tid(page, "version-details")).to_contain_text(f"Rank{adapter.rank}")

    # The page agrees with the database, and the version belongs to the tenant chosen in the form.
    v = db_version(web_stack, name)
    assert v["status"] == "ready" and v["tenant_id"] == web_stack.tenant_id
    expect(tid(page, "version-link")).to_have_attribute("href", f"/admin/versions/{v['id']}")
    expect(tid(page, "recent-uploads")).to_contain_text(f"{name} v1")


def pickle_archive() -> bytes:
    """adapter_config.json plus weights as a pickle (`adapter_model.bin`): code execution on load, refused."""
    config = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                         "task_type": "CAUSAL_LM"}).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for member, data in (("adapter_config.json", config), ("adapter_model.bin", pickle.dumps({"w": [1, 2, 3]}))):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_pickled_upload_is_rejected_and_the_page_shows_why(page, web_stack, tmp_path):
    name = f"pickled-{uuid.uuid4().hex[:6]}"
    archive = tmp_path / "my-adapter.tar.gz"
    archive.write_bytes(pickle_archive())
    open_upload_form(page, web_stack, name)
    tid(page, "upload-mode-archive").check()
    tid(page, "upload-file").set_input_files(archive)
    tid(page, "upload-submit").click()
    expect(tid(page, "upload-progress")).to_have_attribute("data-phase", "done", timeout=30_000)
    expect(tid(page, "version-status")).to_have_text("rejected", timeout=120_000)
    reasons = tid(page, "rejection-reasons")
    expect(reasons).to_contain_text("Why it was rejected")
    expect(reasons).to_contain_text("pickle_file")
    assert len(reasons.inner_text().split("pickle_file", 1)[1].strip()) > 10  # a human-readable message follows the code
    expect(tid(page, "gate-metrics")).to_have_count(0)  # never evaluated, and the steps say so
    states = tid(page, "version-steps").locator("li").evaluate_all("els => els.map(e => e.dataset.state)")
    assert states == ["done", "failed", "skipped", "done"], states
    expect(tid(page, "override-form")).to_have_count(0)  # validation's verdict is not the gate's to overrule
    expect(tid(page, "override-unavailable")).to_be_visible()
    assert db_version(web_stack, name)["status"] == "rejected"

    # The version's own page (a real URL) shows the same after a reload.
    tid(page, "version-link").click()
    page.reload()
    expect(tid(page, "version-status")).to_have_text("rejected")
    expect(tid(page, "rejection-reasons")).to_contain_text("pickle_file")

    # Later, from the tenants list: the tenant's adapters, this version among them, its reasons one click away.
    tid(page, "nav-tenants").click()
    tid(page, "tenant-adapters-demo").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Adapters of Demo Tenant")
    tid(page, "adapters-search").fill(name)  # rejected adapters are collapsed until asked for; a search finds them
    card = tid(page, f"adapter-{name}")
    expect(card).to_contain_text("no active version")
    tid(page, f"adapter-toggle-{name}").click()
    card.locator("[data-testid^='version-toggle-']").click()
    expect(card.get_by_test_id("rejection-reasons")).to_contain_text("pickle_file")
