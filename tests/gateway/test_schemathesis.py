"""Property-based API fuzzing from the gateway's own OpenAPI schema: no input produces a server error.

(Driven with hypothesis directly: schemathesis' pytest plugin does not load under this pytest.)
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import given

from tests.factories import make_api_key, make_tenant
from tests.fuzzing import fuzz_settings


@pytest.fixture(scope="module")
def auth_headers(db_engine):
    from sqlalchemy.orm import Session

    with Session(db_engine, expire_on_commit=False) as db:
        tenant = make_tenant(db, limits={"tokens_per_min": 500_000})
        key = make_api_key(db, tenant=tenant).secret
    return {"authorization": f"Bearer {key}"}


def _realistic(model: str):
    """Half the generated bodies name the real model (so fuzzing reaches the engines), and long
    generations are capped so the run stays short on CPU engines."""

    def fix(case):
        body = case.body
        if isinstance(body, dict):
            if hash(repr(sorted(body, key=str))) % 2 == 0:
                body["model"] = model
            for field in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(field), int) and body[field] > 8:
                    body[field] = 8
            if isinstance(body.get("n"), int) and body["n"] > 2:
                body["n"] = 2
        return case

    return fix


def test_no_server_errors_on_any_operation(stack, demo_kit, auth_headers):
    schema = schemathesis.openapi.from_url(f"{stack.gw.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"}
    calls = 0
    for op in operations:

        @given(case=op.as_strategy().map(_realistic(demo_kit.model_name)))
        @fuzz_settings(30)
        def check(case):
            nonlocal calls
            calls += 1
            response = case.call(headers=auth_headers, timeout=60)
            assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:400]}"

        check()
    assert calls >= 30 * 3 * 0.5
    print(f"\n[schemathesis] {len(operations)} operations, {calls} generated requests, 0 server errors")


def test_no_server_errors_on_any_engine_operation_and_the_engines_stay_alive(stack, demo_kit):
    """The engine's own API (its internal stream, OpenAI endpoints, adapter and admin routes) with the platform
    credential: nothing a caller sends is a 5xx, and after every case every engine still answers /health."""
    auth = stack.engine_headers()
    engine = stack.engines[0].url
    schema = schemathesis.openapi.from_url(f"{engine}/openapi.json", headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /internal/v1/generate", "POST /v1/chat/completions", "POST /v1/completions"} <= paths
    calls = 0
    for op in operations:
        if op.path == "/drain":
            continue  # it does what it says (stops this engine taking requests); tested in test_server

        @given(case=op.as_strategy().map(_realistic(demo_kit.model_name)))
        @fuzz_settings(30)
        def check(case):
            nonlocal calls
            calls += 1
            response = case.call(headers=auth, timeout=60)
            assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:400]}"
            for e in stack.engines:
                assert httpx.get(f"{e.url}/health", timeout=10).status_code == 200, f"{e.url} died after {case.method} {case.formatted_path}"

        check()
    assert calls >= 100  # operations without parameters have one distinct request each
    print(f"\n[schemathesis] engine: {len(operations)} operations, {calls} generated requests, 0 server errors, engines alive")
