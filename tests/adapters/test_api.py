"""The upload API on the real gateway app (uvicorn in a thread, real Postgres and Redis; the pipeline's
workers are not needed to answer 202): both upload forms, the size limit, roles and tenant isolation,
version numbering, the audit trail, and the CLI's upload through the same plain function."""
from __future__ import annotations

import io
import json
import uuid

import httpx
import pytest
from sqlalchemy import select

from services.common.models import Adapter, AdapterStatus, AdapterVersion, AuditLog, Role
from tests.adapters.tinymodel import write_adapter
from tests.factories import make_adapter, make_adapter_version, make_tenant, make_user
from tests.gateway.mgmt_harness import Api, ServedApp

MAX_UPLOAD = 256 * 1024


@pytest.fixture(scope="module")
def gateway(settings, tiny_base, tmp_path_factory):
    """The gateway app serving the tiny base, with a small upload limit (read from the environment)."""
    from services.gateway.app import create_app

    mp = pytest.MonkeyPatch()
    mp.setenv("MPLEX_ADAPTERS_MAX_UPLOAD_BYTES", str(MAX_UPLOAD))
    gw_settings = settings.model_copy(update={"base_model_dir": tiny_base, "base_model_name": "tiny-llama",
                                              "home": tmp_path_factory.mktemp("gw-home")})
    with ServedApp(create_app(gw_settings, web_dist=None)) as served:
        yield served
    mp.undo()


@pytest.fixture
def world(db):
    a, b = make_tenant(db), make_tenant(db)
    return {
        "a": a, "b": b,
        "a_admin": make_user(db, tenant=a, role=Role.TENANT_ADMIN),
        "a_member": make_user(db, tenant=a, role=Role.TENANT_MEMBER),
        "b_admin": make_user(db, tenant=b, role=Role.TENANT_ADMIN),
        "platform": make_user(db, role=Role.PLATFORM_ADMIN),
    }


@pytest.fixture
def signed_in(gateway):
    opened = []

    def open_(user) -> Api:
        api = Api(gateway.url)
        assert api.login(user.email).status_code == 200
        opened.append(api)
        return api

    yield open_
    for api in opened:
        api.close()


@pytest.fixture(scope="module")
def adapter_files(tiny_dims, tmp_path_factory):
    d = write_adapter(tmp_path_factory.mktemp("api-adapter") / "a", tiny_dims, rank=4)
    return {p.name: p.read_bytes() for p in d.iterdir()}


def loose(files: dict[str, bytes]) -> list:
    return [("files", (name, data, "application/octet-stream")) for name, data in files.items()]


def test_platform_admin_uploads_the_two_files_and_gets_a_version_at_once(signed_in, world, adapter_files, db):
    api = signed_in(world["platform"])
    eval_set = b'{"prompt": "hi", "expected": "hello"}\n{"messages": [{"role": "user", "content": "a"}], "expected": "b"}\n'
    r = api.post(f"/api/admin/tenants/{world['b'].id}/adapters",
                 data={"name": "support-bot", "min_margin": "0.2", "min_fp8_agreement": "0.95"},
                 files=loose(adapter_files) + [("eval_set", ("eval.jsonl", eval_set, "application/jsonl"))])
    assert r.status_code == 202, r.text
    body = r.json()
    assert set(body) == {"version_id", "adapter_id", "version", "status"}
    assert (body["version"], body["status"]) == (1, "uploaded")
    v = db.get(AdapterVersion, uuid.UUID(body["version_id"]))
    assert v.tenant_id == world["b"].id and v.status == AdapterStatus.UPLOADED
    assert v.gate_config == {"metric": "rouge_l", "min_margin": 0.2, "min_fp8_agreement": 0.95, "max_regression": 0.05,
                             "regression_confidence": 0.95, "max_malformed_rate": 0.02}
    assert v.eval_set_uri and "/evalsets/" in v.eval_set_uri and "/adapters/" in v.storage_uri
    assert v.eval_set_bytes == len(eval_set)
    assert v.size_bytes == sum(len(b) for b in adapter_files.values())
    audit = db.scalars(select(AuditLog).where(AuditLog.target_id == body["version_id"])).all()
    assert [(a.action, a.actor_user_id, a.tenant_id) for a in audit] == [("adapter.upload", world["platform"].id, world["b"].id)]
    assert audit[0].details["adapter"] == "support-bot" and audit[0].details["content_sha256"] == v.content_sha256

    # The next upload of that name is version 2 of the same adapter, and the tenant's admin sees both.
    r2 = api.post(f"/api/admin/tenants/{world['b'].id}/adapters", data={"name": "support-bot"}, files=loose(adapter_files))
    assert r2.status_code == 202 and r2.json()["version"] == 2 and r2.json()["adapter_id"] == body["adapter_id"]
    listing = signed_in(world["b_admin"]).get("/api/tenant/adapters").json()["data"]
    mine = next(a for a in listing if a["name"] == "support-bot")
    assert [x["version"] for x in mine["versions"]] == [1, 2]
    assert mine["versions"][0]["progress"] == {"percent": 0, "step": "queued for validation"}


def test_tenant_admin_uploads_an_archive_for_their_own_tenant(signed_in, world, adapter_files, db):
    buf = io.BytesIO()
    import tarfile

    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in adapter_files.items():
            info = tarfile.TarInfo(f"my-adapter/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    r = signed_in(world["a_admin"]).post("/api/tenant/adapters", data={"name": "mine"},
                                         files=[("file", ("my-adapter.tar.gz", buf.getvalue(), "application/gzip"))])
    assert r.status_code == 202, r.text
    v = db.get(AdapterVersion, uuid.UUID(r.json()["version_id"]))
    assert v.tenant_id == world["a"].id and v.created_by == world["a_admin"].id
    assert db.get(Adapter, v.adapter_id).name == "mine"


def test_over_the_size_limit_is_an_openai_shaped_413(signed_in, world, adapter_files, db):
    api = signed_in(world["platform"])
    big = {**adapter_files, "adapter_model.safetensors": b"\x00" * (MAX_UPLOAD + 1)}
    before = db.scalar(select(AdapterVersion.id).order_by(AdapterVersion.created_at.desc()).limit(1))
    r = api.post(f"/api/admin/tenants/{world['a'].id}/adapters", data={"name": "huge"}, files=loose(big))
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "upload_too_large" and str(MAX_UPLOAD) in err["message"]
    # Also when the client does not announce a length (chunked): refused while streaming.
    body, ctype = _multipart_body({"name": "huge"}, loose(big))

    def chunks():
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    r = api.post(f"/api/admin/tenants/{world['a'].id}/adapters", content=chunks(), headers={"content-type": ctype})
    assert r.status_code == 413 and r.json()["error"]["code"] == "upload_too_large"
    assert db.scalar(select(AdapterVersion.id).order_by(AdapterVersion.created_at.desc()).limit(1)) == before


def test_over_the_storage_quota_is_an_openai_shaped_413_naming_quota_and_use(signed_in, world, adapter_files, db,
                                                                             tiny_dims, tmp_path):
    """The tenant's own quota (set by a platform admin) fits one adapter: the same files again are free, other
    files are refused with 413 before anything is stored, and the tenant sees its use."""
    admin, tenant_admin = signed_in(world["platform"]), signed_in(world["a_admin"])
    size = sum(len(b) for b in adapter_files.values())
    r = admin.request("PUT", f"/api/admin/tenants/{world['a'].id}/storage", json={"quota_bytes": size + 10})
    assert r.status_code == 200 and r.json() == {"used_bytes": 0, "quota_bytes": size + 10, "remaining_bytes": size + 10,
                                                 "quota_is_default": False}
    assert tenant_admin.post("/api/tenant/adapters", data={"name": "fits"}, files=loose(adapter_files)).status_code == 202
    assert tenant_admin.post("/api/tenant/adapters", data={"name": "fits"}, files=loose(adapter_files)).status_code == 202
    other = write_adapter(tmp_path / "other", tiny_dims, rank=4, seed=99)
    before = db.scalar(select(AdapterVersion.id).order_by(AdapterVersion.created_at.desc()).limit(1))
    r = tenant_admin.post("/api/tenant/adapters", data={"name": "too-much"},
                          files=loose({p.name: p.read_bytes() for p in other.iterdir()}))
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "storage_quota_exceeded", "file")
    assert "Storage quota exceeded" in err["message"] and f"{size:,} bytes" in err["message"] \
        and f"{size + 10:,} bytes" in err["message"]
    assert db.scalar(select(AdapterVersion.id).order_by(AdapterVersion.created_at.desc()).limit(1)) == before
    assert tenant_admin.get("/api/tenant/storage").json() == {"used_bytes": size, "quota_bytes": size + 10,
                                                             "remaining_bytes": 10, "quota_is_default": False}
    # Back to the platform default (10 GiB): the upload fits.
    r = admin.request("PUT", f"/api/admin/tenants/{world['a'].id}/storage", json={"quota_bytes": None})
    assert r.json()["quota_is_default"] is True and r.json()["quota_bytes"] == 10 << 30
    assert admin.get(f"/api/admin/tenants/{world['a'].id}/storage").json()["used_bytes"] == size
    path = f"/api/admin/tenants/{world['a'].id}/storage"
    assert tenant_admin.request("PUT", path, json={"quota_bytes": 1}).status_code == 403
    assert admin.request("PUT", path, json={"quota_bytes": -1}).status_code == 400


def _multipart_body(data: dict, files: list) -> tuple[bytes, str]:
    req = httpx.Request("POST", "http://x/", data=data, files=files)
    return req.read(), req.headers["content-type"]


@pytest.mark.parametrize("form, files, param, code", [
    ({}, "pair", "name", "invalid_name"),
    ({"name": "bad name!"}, "pair", "name", "invalid_name"),
    ({"name": "x"}, None, "file", "missing_upload"),
    ({"name": "x"}, "both", "file", "invalid_upload_form"),
    ({"name": "x", "min_margin": "lots"}, "pair", "min_margin", "invalid_threshold"),
    ({"name": "x", "min_margin": "nan"}, "pair", "min_margin", "invalid_threshold"),
    ({"name": "x", "min_fp8_agreement": "1.5"}, "pair", "min_fp8_agreement", "invalid_threshold"),
    ({"name": "x"}, "bad_eval", "eval_set", "invalid_eval_set"),
    ({"name": "x"}, "two_evals", "eval_set", "invalid_eval_set"),
    ({"name": "x", "surprise": "1"}, "pair", "surprise", "unknown_field"),
    ({"name": "x" * 5000}, "pair", "name", "field_too_long"),
])
def test_bad_forms_are_400_with_the_field_named(signed_in, world, adapter_files, form, files, param, code):
    eval_part = ("eval_set", ("e.jsonl", b'{"prompt": "a", "expected": "b"}\n', "text/plain"))
    parts = {"pair": loose(adapter_files), None: [],
             "both": loose(adapter_files) + [("file", ("a.tar.gz", b"\x1f\x8b", "application/gzip"))],
             "bad_eval": loose(adapter_files) + [("eval_set", ("e.jsonl", b'{"prompt": 1}\n', "text/plain"))],
             "two_evals": loose(adapter_files) + [eval_part, eval_part]}[files]
    url = f"/api/admin/tenants/{world['a'].id}/adapters"
    if parts:
        r = signed_in(world["platform"]).post(url, data=form, files=parts)
    else:  # multipart with text fields only (httpx would send a urlencoded form)
        body = "".join(f'--bnd\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in form.items())
        r = signed_in(world["platform"]).post(url, content=(body + "--bnd--\r\n").encode(),
                                              headers={"content-type": "multipart/form-data; boundary=bnd"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")


def test_not_multipart_is_400(signed_in, world):
    r = signed_in(world["platform"]).post(f"/api/admin/tenants/{world['a'].id}/adapters", json={"name": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_media_type"


def test_roles_and_tenant_isolation(signed_in, world, adapter_files, db, gateway):
    a_admin, a_member = signed_in(world["a_admin"]), signed_in(world["a_member"])
    # A tenant admin cannot use the platform route, for another tenant or even their own.
    for tenant in (world["b"], world["a"]):
        r = a_admin.post(f"/api/admin/tenants/{tenant.id}/adapters", data={"name": "x"}, files=loose(adapter_files))
        assert r.status_code == 403 and r.json()["error"]["code"] == "role_required"
    # A member cannot upload at all; nobody signed out can.
    assert a_member.post("/api/tenant/adapters", data={"name": "x"}, files=loose(adapter_files)).status_code == 403
    anon = Api(gateway.url)
    assert anon.post("/api/tenant/adapters", data={"name": "x"}, files=loose(adapter_files)).status_code == 401
    anon.close()
    # Writes need the CSRF token.
    r = a_admin.post("/api/tenant/adapters", data={"name": "x"}, files=loose(adapter_files), csrf=False)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    # B's adapter versions (with gate results) are invisible to A: 404, never 403, and absent from A's list.
    b_adapter = make_adapter(db, tenant=world["b"])
    b_version = make_adapter_version(db, adapter=b_adapter, status=AdapterStatus.REJECTED)
    r = a_admin.get(f"/api/tenant/adapter-versions/{b_version.id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    listing = a_admin.get("/api/tenant/adapters")
    assert listing.status_code == 200 and str(b_adapter.id) not in listing.text and b_adapter.name not in listing.text
    # A platform admin uploading to an unknown tenant: 404, and nothing stored in the database.
    r = signed_in(world["platform"]).post(f"/api/admin/tenants/{uuid.uuid4()}/adapters", data={"name": "x"},
                                          files=loose(adapter_files))
    assert r.status_code == 404


def test_a_tenant_upload_lands_in_the_callers_tenant_whatever_the_form_says(signed_in, world, adapter_files, db):
    r = signed_in(world["a_admin"]).post("/api/tenant/adapters", data={"name": "scoped"}, files=loose(adapter_files))
    assert r.status_code == 202
    assert db.get(AdapterVersion, uuid.UUID(r.json()["version_id"])).tenant_id == world["a"].id
    # And B's admin cannot read it.
    assert signed_in(world["b_admin"]).get(f"/api/tenant/adapter-versions/{r.json()['version_id']}").status_code == 404


def test_the_cli_uploads_through_the_same_function(world, tiny_base, tiny_dims, tmp_path, db, settings):
    """`mplex adapters upload DIR --tenant T --eval-set F` (run in this process with typer's runner); the
    adapter is named after the directory unless --name says otherwise."""
    from typer.testing import CliRunner

    from services.adapters.cli import app

    adapter = write_adapter(tmp_path / "cli-adapter", tiny_dims, rank=4, seed=3)
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text(json.dumps({"prompt": "a", "expected": "b"}) + "\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("MPLEX_BASE_MODEL_DIR", str(tiny_base))
    mp.setenv("MPLEX_BASE_MODEL_NAME", "tiny-llama")
    from services.common.settings import get_settings

    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["upload", str(adapter), "--tenant", world["a"].slug,
                                          "--eval-set", str(eval_set), "--min-margin", "0.1", "--json"])
        renamed = CliRunner().invoke(app, ["upload", str(adapter), "--tenant", world["a"].slug, "--name", "from-cli",
                                           "--json"])
    finally:
        mp.undo()
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    v = db.get(AdapterVersion, uuid.UUID(out["version_id"]))
    assert (v.tenant_id, v.version, v.status) == (world["a"].id, 1, AdapterStatus.UPLOADED)
    assert v.gate_config["min_margin"] == 0.1 and v.eval_set_uri is not None
    assert db.get(Adapter, v.adapter_id).name == "cli-adapter"
    assert renamed.exit_code == 0, renamed.output
    again = db.get(AdapterVersion, uuid.UUID(json.loads(renamed.stdout)["version_id"]))
    assert db.get(Adapter, again.adapter_id).name == "from-cli" and again.content_sha256 == v.content_sha256
    audit = db.scalar(select(AuditLog).where(AuditLog.target_id == out["version_id"]))
    assert audit.action == "adapter.upload" and audit.details["via"] == "cli"


def test_mangled_multipart_bodies_are_4xx_never_server_errors(signed_in, world, adapter_files, db):
    """Byte-level mutations of a valid upload (headers, boundaries, lengths): every answer is a 2xx or an
    OpenAI-shaped 4xx with a code — a body is the client's input, never a reason for a 500."""
    import random

    api = signed_in(world["platform"])
    body, ctype = _multipart_body({"name": "mangled", "min_margin": "0.1"}, loose(adapter_files))
    rng = random.Random(5)
    seen = set()
    for _ in range(40):
        data = bytearray(body)
        for _ in range(rng.randint(1, 6)):
            pos = rng.randrange(len(data) if rng.random() < 0.3 else min(len(data), 600))  # mostly the headers
            op = rng.random()
            if op < 0.5:
                data[pos] = rng.choice(b'\r\n-";=:\x00\xffabc')
            elif op < 0.8:
                del data[pos:pos + rng.randint(1, 40)]
            else:
                data[pos:pos] = rng.choice([b"\r\n", b"--", b'"', b"\r\n\r\n", b"; filename=\"../x\""])
        r = api.post(f"/api/admin/tenants/{world['a'].id}/adapters", content=bytes(data), headers={"content-type": ctype})
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["code"] and err["message"], err
        seen.add(r.status_code)
    assert 400 in seen
