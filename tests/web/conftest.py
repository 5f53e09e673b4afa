"""Browser tests of the web app against the real stack: Debian's Chromium driven by Playwright (sync API).

One stack for the whole directory (session scope): a database of its own (migrated, seeded like `make up`:
the demo tenant, one user per role, demo prices), the test Redis, one engine on the demo model, a Celery
worker for the adapter and batch queues, and the gateway serving the built app (web/dist). The database is private so
that the finance totals checked against it are this stack's traffic only, not other test modules' rows.

Every test gets a fresh browser context; its final page is saved to test-artifacts/web/<test>.png and any
console error or uncaught page error fails it.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.stack import Stack
from tests.web.helpers import DESKTOP

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "web" / "dist"
ARTIFACTS = ROOT / "test-artifacts" / "web"
CHROMIUM = Path(os.environ.get("MPLEX_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu"]
# The gate on a small slice of the eval set: the demo adapters beat the base by a wide margin on any slice.
GATE_ENV = {"MPLEX_ADAPTERS_MAX_EXAMPLES": "12", "MPLEX_ADAPTERS_MAX_NEW_TOKENS": "24",
            "MPLEX_ADAPTERS_LATENCY_SAMPLES": "1"}


@dataclass
class WebStack:
    url: str
    stack: Stack
    kit: object  # services.modelkit.DemoKit
    tenant_id: uuid.UUID
    api_key: str  # the seeded demo key
    database_url: str
    db_engine: object  # SQLAlchemy engine on the private database


@pytest.fixture(scope="session")
def web_dist() -> Path:
    if not (DIST / "index.html").exists():
        pytest.fail("web/dist is not built: run `make web` (make test does it first)")
    return DIST


@pytest.fixture(scope="session")
def web_database_url(service_urls) -> Iterator[str]:
    """A database for the web stack alone, migrated by Alembic, dropped afterwards."""
    from sqlalchemy import make_url, text

    from services.common.db import make_db_engine
    from services.common.migrate import upgrade

    server = make_url(service_urls.database_url)
    admin = make_db_engine(server.set(database="postgres").render_as_string(hide_password=False),
                        pool_size=1, max_overflow=0, isolation_level="AUTOCOMMIT")
    name = f"mplex_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"  # the root conftest's pattern: dropped if we die
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = server.set(database=name).render_as_string(hide_password=False)
        upgrade(url)
        yield url
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture(scope="session")
def web_stack(web_dist, web_database_url, stack_env, service_urls, demo_kit, tmp_path_factory) -> Iterator[WebStack]:
    import redis
    from sqlalchemy.orm import Session

    from services.adapters.base_model import ensure_base_model
    from services.billing.pricebook import seed_demo_prices
    from services.common.db import make_db_engine
    from services.gateway.seed import seed_demo
    kit = demo_kit
    engine = make_db_engine(web_database_url, pool_size=2, max_overflow=2)
    with Session(engine) as s:
        seed = seed_demo(s)
        ensure_base_model(s, name=kit.model_name, model_dir=kit.base_dir)  # prices refer to it
        seed_demo_prices(s, base_model=kit.model_name)
        s.commit()
    # Adapter tasks other modules queued for a worker that never ran belong to another database.
    client = redis.Redis.from_url(service_urls.broker_url)
    client.delete("adapters.ingest", "adapters.eval", "batches")
    client.close()
    env = {**stack_env, "MPLEX_DATABASE_URL": web_database_url, "MPLEX_HOME": str(tmp_path_factory.mktemp("web-home")),
           "MPLEX_BASE_MODEL_DIR": str(kit.base_dir), "MPLEX_BASE_MODEL_NAME": kit.model_name, **GATE_ENV}
    stack = Stack(env, tmp_path_factory.mktemp("web-stack-logs"))
    try:
        stack.engine(kit.base_dir, kit.model_name, f"web-eng-{os.getpid()}", kv_mb=64, max_loras=4, wait=False)
        stack.worker("adapters.ingest,adapters.eval,batches", wait=False)
        gw = stack.gateway(kit.base_dir, kit.model_name, wait=False)
        stack.wait_ready(*stack.procs)
        yield WebStack(gw.url, stack, kit, seed.tenant_id, seed.api_key, web_database_url, engine)
    finally:
        stack.close()
        engine.dispose()


@pytest.fixture(scope="module")
def browser(web_stack) -> Iterator:
    """Per module, not per session: while Playwright's sync API is open, its event loop counts as running in
    this thread, and any later test in the same worker that calls asyncio.run() fails ("cannot be called from
    a running event loop"). Session-scoped, that held only because tests/web come last in collection order:
    with `--dist loadscope` 26 tests in other directories failed so."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium package (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def viewport(request) -> dict:
    """1280 px wide unless a test asks otherwise: `@pytest.mark.parametrize("viewport", [PHONE], indirect=True)`."""
    return getattr(request, "param", DESKTOP)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report


class BrowserProblems(list):
    """Console errors and uncaught exceptions seen by a page; the test fails if any remain at the end."""


@pytest.fixture
def page(browser, web_stack, viewport, request) -> Iterator:
    context = browser.new_context(viewport=viewport, base_url=web_stack.url, accept_downloads=True, locale="en-US",
                                  timezone_id="UTC")
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=web_stack.url)
    page = context.new_page()
    problems = BrowserProblems()
    page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text} ({m.location})") if m.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.problems = problems
    try:
        yield page
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name).strip("_")
        try:
            page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        finally:
            context.close()
            report = getattr(request.node, "rep_call", None)
            if report is not None and report.failed:  # the stack's side of the story, next to the screenshot
                shutil.copytree(web_stack.stack.log_dir, ARTIFACTS / f"{name}-logs", dirs_exist_ok=True)
    assert not problems, "the browser reported errors:\n" + "\n".join(problems)
