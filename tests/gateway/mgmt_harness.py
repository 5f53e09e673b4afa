"""The real gateway app for management-API tests: `create_app` served by uvicorn in a thread on the test
Postgres and Redis (no engines: the management routes need none), signed-in HTTP clients, and a small
world of two tenants with users, keys, adapters and usage.

Test modules import the fixtures they use (`from tests.gateway.mgmt_harness import gateway, world, ...`).
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from services.common.batch_contract import batch_public_id, file_public_id

from tests.factories import (
    DEFAULT_PASSWORD,
    make_adapter,
    make_adapter_version,
    make_api_key,
    make_tenant,
    make_usage_event,
    make_user,
)
from tests.stack import free_port

KEY_CACHE_TTL_S = 300.0  # long on purpose: a change seen within a test proves the cache was dropped, not expired
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def write_tokenizer_model_dir(path: Path) -> Path:
    """A base-model directory as far as the gateway reads one: config.json (context length) and a real
    tokenizers tokenizer.json. Weights are an engine's business, and these tests run no engine."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "a", "is", "of", "and"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 512,
                                                  "vocab_size": len(words)}))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


class ServedApp:
    """uvicorn running an ASGI app on a free local port in a daemon thread (lifespan included)."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="gateway-under-test", daemon=True)

    def __enter__(self) -> ServedApp:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start (see the log above)")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@dataclass
class Gateway:
    url: str
    app: object
    settings: object


def make_gateway_settings(settings, tmp_path_factory, **overrides):
    model_dir = write_tokenizer_model_dir(tmp_path_factory.mktemp("base-model"))
    return settings.model_copy(update={"base_model_dir": model_dir, "key_cache_ttl_s": KEY_CACHE_TTL_S, **overrides})


@pytest.fixture(scope="module")
def gateway(settings, tmp_path_factory):
    from services.gateway.app import create_app

    gw_settings = make_gateway_settings(settings, tmp_path_factory)
    app = create_app(gw_settings, web_dist=None)
    with ServedApp(app) as served:
        yield Gateway(served.url, app, gw_settings)


class Api:
    """One browser: its own cookie jar, and the CSRF token sent on writes once signed in."""

    def __init__(self, base_url: str):
        self.http = httpx.Client(base_url=base_url, timeout=60)
        self.csrf: str | None = None
        self.user: dict | None = None

    def login(self, email: str, password: str = DEFAULT_PASSWORD) -> httpx.Response:
        r = self.http.post("/api/auth/login", json={"email": email, "password": password})
        if r.status_code == 200:
            self.csrf, self.user = r.json()["csrf_token"], r.json()["user"]
        return r

    def request(self, method: str, path: str, *, csrf: bool = True, **kwargs) -> httpx.Response:
        headers = dict(kwargs.pop("headers", None) or {})
        if csrf and self.csrf and method.upper() not in SAFE_METHODS:
            headers.setdefault("x-csrf-token", self.csrf)
        return self.http.request(method, path, headers=headers, **kwargs)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.request("POST", path, **kw)

    def patch(self, path: str, **kw) -> httpx.Response:
        return self.request("PATCH", path, **kw)

    def delete(self, path: str, **kw) -> httpx.Response:
        return self.request("DELETE", path, **kw)

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def browser(gateway):
    """A factory of clients; `browser(email)` is already signed in."""
    opened: list[Api] = []

    def open_(email: str | None = None, password: str = DEFAULT_PASSWORD) -> Api:
        api = Api(gateway.url)
        opened.append(api)
        if email is not None:
            r = api.login(email, password)
            assert r.status_code == 200, r.text
        return api

    yield open_
    for api in opened:
        api.close()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def v1_models(gateway: Gateway, key: str) -> httpx.Response:
    return httpx.get(f"{gateway.url}/v1/models", headers=bearer(key), timeout=30)


@dataclass
class TenantWorld:
    tenant: object
    admin: object  # User rows
    member: object
    key: object  # tests.factories.CreatedKey
    adapter: object
    v1: object  # ready, active
    v2: object  # rejected by the gate
    event: object  # a usage event (a request made with `key` through `adapter` v1)
    batch: object  # a Batch API batch (in progress) and its input file
    batch_file: object
    ids: dict[str, str] = field(default_factory=dict)

    def markers(self) -> list[str]:
        """Strings that identify this tenant's objects: none may appear in another tenant's responses."""
        return [str(self.tenant.id), self.tenant.slug, self.tenant.name, str(self.key.row.id), self.key.row.prefix,
                self.key.row.name, str(self.adapter.id), self.adapter.name, str(self.v1.id), str(self.v2.id),
                self.v1.content_sha256, self.v2.content_sha256, self.admin.email, self.member.email,
                self.event.request_id, batch_public_id(self.batch.id), file_public_id(self.batch_file.id)]


@dataclass
class World:
    a: TenantWorld
    b: TenantWorld
    platform_admin: object
    finance: object

    def email(self, role: str) -> str:
        return {"tenant_member": self.a.member.email, "tenant_admin": self.a.admin.email,
                "platform_admin": self.platform_admin.email, "finance": self.finance.email}[role]


def make_batch(db, *, tenant, api_key, store):
    """An in-progress batch of one line and its input file, stored (no worker runs it here)."""
    from datetime import datetime, timedelta, timezone

    from services.common.batch_contract import BatchStatus
    from services.common.models import Batch
    from services.gateway.batch_files import put_file

    line = json.dumps({"custom_id": f"bola-{tenant.slug}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "hi"}}).encode()
    f = put_file(store, db, tenant_id=tenant.id, data=line, filename="in.jsonl", purpose="batch", line_count=1)
    now = datetime.now(timezone.utc)
    b = Batch(tenant_id=tenant.id, api_key_id=api_key.id, input_file_id=f.id, endpoint="/v1/completions",
              completion_window="24h", status=BatchStatus.IN_PROGRESS, total=1, expires_at=now + timedelta(days=1),
              in_progress_at=now)
    db.add(b)
    db.commit()
    return f, b


def make_tenant_world(db, label: str, store) -> TenantWorld:
    from services.common.models import AdapterStatus, Role

    from tests.factories import unique

    tenant = make_tenant(db, name=f"Tenant {label} {uuid.uuid4().hex[:6]}", limits={"tokens_per_min": 100_000})
    admin = make_user(db, tenant=tenant, role=Role.TENANT_ADMIN)
    member = make_user(db, tenant=tenant, role=Role.TENANT_MEMBER)
    key = make_api_key(db, tenant=tenant, name=unique(f"key-{label}"))
    adapter = make_adapter(db, tenant=tenant, name=unique(f"adapter-{label}"))
    v1 = make_adapter_version(db, adapter=adapter, status=AdapterStatus.READY, rank=8, activate=True)
    v2 = make_adapter_version(db, adapter=adapter, status=AdapterStatus.REJECTED, rank=8)
    v2.status_reasons = [{"code": "margin_below_threshold", "message": "adapter does not beat the base model"}]
    db.commit()
    event = make_usage_event(db, tenant=tenant, api_key=key.row, adapter_version=v1, model=adapter.name,
                             prompt_tokens=30, completion_tokens=12)
    batch_file, batch = make_batch(db, tenant=tenant, api_key=key.row, store=store)
    return TenantWorld(tenant, admin, member, key, adapter, v1, v2, event, batch, batch_file)


@pytest.fixture(scope="module")
def world(db_engine, gateway) -> World:
    from sqlalchemy.orm import Session

    from services.adapters.storage import ObjectStore
    from services.common.models import Role

    store = ObjectStore.from_settings(gateway.settings)  # where the gateway reads batch files from
    with Session(db_engine, expire_on_commit=False) as db:
        a, b = make_tenant_world(db, "a", store), make_tenant_world(db, "b", store)
        return World(a, b, make_user(db, role=Role.PLATFORM_ADMIN), make_user(db, role=Role.FINANCE))


def audit_count(db_engine, world: World) -> int:
    """Audit rows about the world's tenants or written by its users (every management write adds one)."""
    from sqlalchemy import func, or_, select
    from sqlalchemy.orm import Session

    from services.common.models import AuditLog

    tenants = [world.a.tenant.id, world.b.tenant.id]
    users = [world.a.admin.id, world.a.member.id, world.b.admin.id, world.b.member.id, world.platform_admin.id,
             world.finance.id]
    with Session(db_engine) as s:
        return s.scalar(select(func.count()).select_from(AuditLog).where(
            or_(AuditLog.tenant_id.in_(tenants), AuditLog.actor_user_id.in_(users))))
