"""Request ids thread gateway -> engine -> ledger; logs are JSON lines; health and readiness answer."""
from __future__ import annotations

import json
import time

import httpx
from sqlalchemy import select

from services.common.models import UsageEvent
from tests.factories import make_api_key, make_tenant


def _json_lines(path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_client_request_id_appears_in_gateway_log_engine_log_and_ledger(stack, demo_kit, db):
    key = make_api_key(db, tenant=make_tenant(db)).secret
    trace = f"trace-{time.time_ns()}"
    r = httpx.post(f"{stack.gw.url}/v1/chat/completions", timeout=60,
                   headers={"authorization": f"Bearer {key}", "x-client-request-id": trace},
                   json={"model": demo_kit.model_name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    deadline = time.time() + 10
    row = None
    while time.time() < deadline and row is None:
        db.expire_all()
        row = db.execute(select(UsageEvent).where(UsageEvent.request_id == rid)).scalar_one_or_none()
        time.sleep(0.1)
    assert row is not None and row.client_request_id == trace
    gw_records = [x for x in _json_lines(stack.gw.log) if x.get("request_id") == rid]
    assert any(x.get("client_request_id") == trace and x["msg"] == "request finished" for x in gw_records)
    engine_records = [x for e in stack.engines for x in _json_lines(e.log) if x.get("request_id") == rid]
    assert {x["msg"] for x in engine_records} >= {"request accepted", "request finished"}
    assert all(x.get("client_request_id") == trace for x in engine_records)
    assert all(x["service"] == "engine" for x in engine_records)


def test_logs_never_contain_api_keys(stack, db):
    key = make_api_key(db, tenant=make_tenant(db)).secret
    httpx.get(f"{stack.gw.url}/v1/models", headers={"authorization": f"Bearer {key}"})
    httpx.get(f"{stack.gw.url}/v1/models", headers={"authorization": f"Bearer {key[:-2]}xx"})
    for proc in [stack.gw, *stack.engines]:
        assert key not in proc.log.read_text(errors="replace")


def test_health_and_ready(stack):
    auth = stack.engine_headers()
    for proc in [stack.gw, *stack.engines]:
        assert httpx.get(f"{proc.url}/health").status_code == 200
        # An engine's /ready is behind the platform credential like everything but /health.
        headers = auth if proc in stack.engines else {}
        assert httpx.get(f"{proc.url}/ready", headers=headers).status_code == 200
    for e in stack.engines:
        assert httpx.get(f"{e.url}/ready").status_code == 401
    ready = httpx.get(f"{stack.gw.url}/ready").json()
    assert ready["checks"] == {"redis": "ok", "postgres": "ok"}
