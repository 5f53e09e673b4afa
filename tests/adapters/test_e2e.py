"""The adapter lifecycle end to end on real processes — an engine, the gateway and a Celery worker (`mplex ...`
subprocesses on the test Postgres and Redis) serving the trained demo kit:

- the demo adapters, seeded through the pipeline as `make up` does, go uploaded -> ready and are served by name
  through the gateway (OpenAI SDK), token for token what the engine itself answers with the kit's files;
- an untrained (random) adapter is rejected by the quality gate, with reasons and the per-example outputs;
- without an eval set, a harmless adapter goes ready and a damaging one is refused (no-regression check);
- beat's storage collection, run by the worker, removes expired files and keeps files a ready version shares;
- the malicious corpus is refused case by case with its code; the worker never crashes; nothing is written
  outside the sandbox;
- a new version of a name never serves the old version's KV; rollback serves the old one again; deleting the
  adapter makes the engine unload it;
- the worker process running the gate is SIGKILLed: the task is redelivered and the version ends in one
  final state with one eval run.

One stack for the module (starting it is most of the cost); tests share it and use their own names.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from openai import OpenAI
from sqlalchemy import func, select, update

from services.common.db import make_sessionmaker
from services.common.lora_format import content_id, read_config
from services.common.models import Adapter, AdapterVersion, EvalRun, EvalRunStatus, Role
from tests.adapters.corpus import build_corpus
from tests.adapters import helpers
from tests.adapters.tinymodel import dims_of
from tests.factories import DEFAULT_PASSWORD, make_api_key, make_tenant, make_user
from tests.gateway.mgmt_harness import Api
from tests.stack import Stack

pytestmark = pytest.mark.slow

# The SIGKILL test needs a gate that runs for seconds: it brings a big eval set, which this cap lets through.
# (The demo eval sets have 40 items, under the default cap of 64, so nothing else changes.)
WORKER_ENV = {"MPLEX_ADAPTERS_MAX_EXAMPLES": "2000"}


@pytest.fixture(scope="module")
def stack(stack_env, demo_kit, tmp_path_factory, service_urls):
    _purge_adapter_queues(service_urls.broker_url)
    env = {"MPLEX_BASE_MODEL_DIR": str(demo_kit.base_dir), "MPLEX_BASE_MODEL_NAME": demo_kit.model_name}
    s = Stack({**stack_env, **env}, tmp_path_factory.mktemp("adapter-stack-logs"))
    try:
        s.engine_proc = s.engine(demo_kit.base_dir, demo_kit.model_name, f"adapters-eng-{os.getpid()}", kv_mb=64,
                                 max_loras=4, wait=False)
        s.gw = s.gateway(demo_kit.base_dir, demo_kit.model_name, wait=False)
        s.worker_proc = s.worker("adapters.ingest,adapters.eval", env=WORKER_ENV, wait=False)
        s.wait_ready(s.engine_proc, s.gw, s.worker_proc)
        _STACKS.append(s)
        yield s
        _STACKS.remove(s)
    finally:
        s.close()


_STACKS: list[Stack] = []  # the module's stack, for the report a timed-out wait gives


def wait_final(factory, version_id, timeout: float = 300) -> str:
    try:
        return helpers.wait_final(factory, version_id, timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_worker_report()}") from None


def _worker_report() -> str:
    """Why the worker decided nothing: alive or not, its log's tail and where each of its processes stands
    (py-spy), so a CI failure can be read without rerunning it."""
    import shutil
    import subprocess

    if not _STACKS:
        return ""
    proc = _STACKS[-1].worker_proc
    lines = [f"worker pid {proc.popen.pid} exit code {proc.popen.poll()}", proc.tail(4000)]
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        pids = [proc.popen.pid, *(c.pid for c in psutil.Process(proc.popen.pid).children(recursive=True))]
    except psutil.Error:
        pids = []
    for pid in pids:
        try:
            out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            lines.append(f"-- py-spy {pid}:\n{out.stdout[-3000:]}{out.stderr[-500:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"-- py-spy {pid}: {e}")
    lines.append(_database_waits(_STACKS[-1].env["MPLEX_DATABASE_URL"]))
    return "\n".join(lines)


def _database_waits(url: str) -> str:
    """Sessions of the test database that hold a transaction open or wait on a lock, and who blocks them."""
    import psycopg

    try:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid), now() - xact_start,"
                " left(query, 160) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND (state <> 'idle' OR wait_event_type = 'Lock')").fetchall()
    except psycopg.Error as e:
        return f"-- database: {e}"
    return "-- database sessions:\n" + "\n".join(map(str, rows))


def _purge_adapter_queues(broker_url: str) -> None:
    """Messages other test modules left for a worker that never ran (their versions are not ours)."""
    client = redis.Redis.from_url(broker_url)
    client.delete("adapters.ingest", "adapters.eval")
    client.close()


@pytest.fixture(scope="module")
def people(db_engine):
    from sqlalchemy.orm import Session

    with Session(db_engine, expire_on_commit=False) as db:
        tenant = make_tenant(db, limits={"tokens_per_min": 1_000_000})
        return {"tenant": tenant, "admin": make_user(db, role=Role.PLATFORM_ADMIN),
                "tenant_admin": make_user(db, tenant=tenant, role=Role.TENANT_ADMIN),
                "key": make_api_key(db, tenant=tenant).secret}


def signed_in(stack: Stack, user) -> Api:
    api = Api(stack.gw.url)
    assert api.login(user.email, DEFAULT_PASSWORD).status_code == 200
    return api


@pytest.fixture
def admin(stack, people):
    api = signed_in(stack, people["admin"])
    yield api
    api.close()


@pytest.fixture(scope="module")
def factory(db_engine):
    return make_sessionmaker(db_engine)


@pytest.fixture(scope="module")
def client(stack, people) -> OpenAI:
    return OpenAI(base_url=f"{stack.gw.url}/v1", api_key=people["key"], max_retries=0)


def upload_dir(api: Api, tenant_id, name: str, adapter_dir: Path, eval_set: bytes | None = None, **form) -> dict:
    files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in sorted(adapter_dir.iterdir())]
    if eval_set is not None:
        files.append(("eval_set", ("eval.jsonl", eval_set, "application/jsonl")))
    r = api.post(f"/api/admin/tenants/{tenant_id}/adapters", data={"name": name, **{k: str(v) for k, v in form.items()}},
                 files=files)
    assert r.status_code == 202, r.text
    return r.json()


def eval_prompts(demo, n: int) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(demo.eval_path).read_text().splitlines()[:n]]


def engine_metric(stack: Stack, name: str) -> float:
    text = httpx.get(f"{stack.engine_proc.url}/metrics", headers=stack.engine_headers(), timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def chat(client: OpenAI, model: str, prompt: str, max_tokens: int = 24):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=max_tokens, temperature=0)


def _version(factory, version_id) -> AdapterVersion:
    with factory() as s:
        return s.get(AdapterVersion, uuid.UUID(str(version_id)))


def _until(predicate, timeout: float = 30, interval: float = 0.3) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met in time\n{_worker_report()}")


def test_the_demo_adapters_go_ready_and_are_served_by_name_exactly_as_the_engine_serves_them(
        stack, admin, people, factory, client, demo_kit, settings):
    from services.adapters.seed import seed_demo_adapters
    from services.adapters.tasks import enqueue_ingest

    # What `make up` does: every demo adapter uploaded with its task's eval set, the pipeline left to the worker.
    stack_settings = settings.model_copy(update={"base_model_dir": Path(demo_kit.base_dir),
                                                 "base_model_name": demo_kit.model_name})
    seeded = {a.name: a for a in seed_demo_adapters(tenant=people["tenant"].slug, kit=demo_kit, settings=stack_settings,
                                                    session_factory=factory, enqueue=enqueue_ingest)}
    assert set(seeded) == set(demo_kit.adapters) and all(a.created and a.version == 1 for a in seeded.values())
    seen: set[str] = set()
    watched = seeded["reverse"].version_id
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the progress bar's poll
        v = admin.get(f"/api/admin/adapter-versions/{watched}").json()
        seen.add(v["status"])
        if v["status"] in ("ready", "rejected"):
            break
        time.sleep(0.1)
    assert v["status"] == "ready", (v, _worker_report())
    assert seen <= {"uploaded", "validating", "evaluating", "ready"} and v["progress"] == {"percent": 100, "step": "ready"}
    for name, a in seeded.items():
        assert wait_final(factory, a.version_id) == "ready", (name, _version(factory, a.version_id).status_reasons)
    tenant_admin = signed_in(stack, people["tenant_admin"])
    for name, demo in demo_kit.adapters.items():
        v = tenant_admin.get(f"/api/tenant/adapter-versions/{seeded[name].version_id}").json()
        assert v["rank"] == read_config(demo.path).max_rank and v["eval"]["passed"] is True  # with rank_pattern
        m = v["eval"]["metrics"]
        assert m["adapter"]["rouge_l"] - m["base"]["rouge_l"] >= v["eval"]["thresholds"]["min_margin"]
        assert m["served_weight_dtype"] == "fp8" and m["fp8_token_agreement"] >= v["eval"]["thresholds"]["min_fp8_agreement"]
        assert m["n_examples"] == 40 and len(v["eval"]["examples"]) == 20  # the summary keeps the first 20
    tenant_admin.close()
    # Seeding again (a second `make up`) changes nothing: same versions, nothing enqueued.
    again = seed_demo_adapters(tenant=people["tenant"].slug, kit=demo_kit, settings=stack_settings,
                               session_factory=factory, enqueue=lambda vid: pytest.fail("re-enqueued a decided version"))
    assert {a.name: (a.version_id, a.created) for a in again} == {n: (a.version_id, False) for n, a in seeded.items()}

    assert set(demo_kit.adapters) <= {m.id for m in client.models.list().data}
    auth = stack.engine_headers()
    direct = OpenAI(base_url=f"{stack.engine_proc.url}/v1", api_key=auth["Authorization"].removeprefix("Bearer "),
                    max_retries=0)
    for name in ("reverse", "uppercase"):
        demo = demo_kit.adapters[name]
        prompts = eval_prompts(demo, 3)
        via_gateway = [chat(client, name, p).choices[0].message.content for p in prompts]
        # The engine's own answer with the kit's files, loaded straight into it (no gateway, no pipeline) from
        # where the upload stored them: the object store is the only place an engine reads adapters from.
        version = _version(factory, seeded[name].version_id)
        r = httpx.post(f"{stack.engine_proc.url}/internal/v1/adapters", timeout=60, headers=auth,
                       json={"name": f"direct-{name}", "path": version.storage_uri})
        assert r.status_code == 200, r.text
        assert r.json()["content_id"] == version.content_sha256 == content_id(demo.path)
        assert via_gateway == [chat(direct, f"direct-{name}", p).choices[0].message.content for p in prompts]
        assert via_gateway != [chat(client, demo_kit.model_name, p).choices[0].message.content for p in prompts]


def test_an_untrained_random_adapter_is_rejected_by_the_gate_with_reasons(stack, admin, people, factory, demo_kit,
                                                                          tmp_path):
    from services.modelkit import make_random_adapter

    demo = demo_kit.adapters["reverse"]
    random_dir = make_random_adapter(demo_kit.base_dir, tmp_path / "untrained", rank=16, seed=1234,
                                     target_modules=demo.target_modules)
    up = upload_dir(admin, people["tenant"].id, "untrained", random_dir, Path(demo.eval_path).read_bytes())
    assert wait_final(factory, up["version_id"]) == "rejected"
    tenant_admin = signed_in(stack, people["tenant_admin"])
    v = tenant_admin.get(f"/api/tenant/adapter-versions/{up['version_id']}").json()
    tenant_admin.close()
    # Its near-flat logits may also flip greedy tokens under FP8, and its noise may make some answers loop or
    # come out empty where the base's do not (on the pinned kit: both): those reasons are legitimate too.
    codes = [r["code"] for r in v["reasons"]]
    assert codes[0] == "margin_below_threshold" and set(codes) <= {
        "margin_below_threshold", "fp8_agreement_below_threshold", "malformed_outputs"}
    assert "must beat the base" in v["reasons"][0]["message"]
    m = v["eval"]["metrics"]
    assert v["eval"]["passed"] is False and m["adapter"]["rouge_l"] < m["base"]["rouge_l"] + 0.05
    ex = v["eval"]["examples"][0]
    assert set(ex) >= {"prompt", "expected", "adapter", "base", "full_precision"}
    with factory() as s:
        (run,) = s.scalars(select(EvalRun).where(EvalRun.adapter_version_id == uuid.UUID(up["version_id"]))).all()
        assert run.status == EvalRunStatus.FINISHED and len(run.examples) == 40
        assert s.get(Adapter, uuid.UUID(up["adapter_id"])).active_version_id is None  # never routable


def test_without_an_eval_set_a_harmless_adapter_goes_ready_and_a_damaging_one_is_refused(stack, admin, people, factory,
                                                                                         demo_kit, tmp_path):
    """The default gate through the real gateway and worker: no eval set, so the no-regression check on the
    base-capability set; the version's `eval.reasons` lists every check, passed ones too, with its value."""
    from services.modelkit import make_random_adapter

    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    harmless = make_random_adapter(demo_kit.base_dir, tmp_path / "harmless", rank=16, seed=77, init_scale=0.02,
                                   target_modules=modules)
    damaging = make_random_adapter(demo_kit.base_dir, tmp_path / "damaging", rank=16, seed=77, init_scale=3.0,
                                   target_modules=modules)
    ups = {name: upload_dir(admin, people["tenant"].id, name, d) for name, d in (("harmless", harmless), ("damaging", damaging))}
    tenant_admin = signed_in(stack, people["tenant_admin"])
    try:
        got = {}
        for name, up in ups.items():
            wait_final(factory, up["version_id"])
            got[name] = tenant_admin.get(f"/api/tenant/adapter-versions/{up['version_id']}").json()
    finally:
        tenant_admin.close()
    ok, bad = got["harmless"], got["damaging"]
    assert ok["status"] == "ready" and ok["reasons"] == [] and ok["eval"]["passed"] is True
    assert [(r["check"], r["passed"]) for r in ok["eval"]["reasons"]] == \
        [("no_regression", True), ("well_formed", True), ("logits", True), ("fp8_agreement", True)]
    assert all(r["value"] is not None and r["threshold"] is not None and r["message"] for r in ok["eval"]["reasons"])
    m = ok["eval"]["metrics"]
    assert m["check"] == "no_regression" and m["eval_set"] == "default" and m["n_examples"] == 200
    assert bad["status"] == "rejected" and bad["reasons"][0]["code"] == "regression_over_tolerance"
    assert {r["code"] for r in bad["reasons"]} == {r["code"] for r in bad["eval"]["reasons"] if not r["passed"]}
    assert len(bad["eval"]["reasons"]) == 4 and bad["eval"]["metrics"]["regression"]["mean_drop"] > 0.5


def test_beat_s_storage_collection_on_the_worker_removes_expired_files_and_keeps_shared_ones(
        stack, admin, people, factory, demo_kit, settings, tmp_path):
    """What beat runs hourly (`adapters.ingest.collect_storage`), sent to the real worker: a hostile upload and a
    rejected version past their retention lose their files; the rejected version's files are kept because a
    ready version has the same bytes (its eval set, its own, goes)."""
    from services.adapters.tasks import collect_storage
    from services.common.models import AdapterStatus
    from services.modelkit import make_random_adapter

    harmless = make_random_adapter(demo_kit.base_dir, tmp_path / "keep", rank=8, seed=4242, init_scale=0.02,
                                   target_modules=("q_proj", "v_proj"))
    ready = upload_dir(admin, people["tenant"].id, "kept-files", harmless)
    # The same files with a task eval set they cannot pass (a harmless adapter does not reverse words); one of
    # its own bytes (other tests upload the kit's reverse set, whose object is shared and so stays).
    task_set = Path(demo_kit.adapters["reverse"].eval_path).read_bytes() + \
        json.dumps({"prompt": f"Reverse the words: {uuid.uuid4().hex}", "expected": "x"}).encode() + b"\n"
    rejected = upload_dir(admin, people["tenant"].id, "kept-files-task", harmless, task_set)
    r = admin.post(f"/api/admin/tenants/{people['tenant'].id}/adapters", data={"name": "hostile-expired"},
                   files=[("file", ("a.tar", _hostile_tar(), "application/x-tar"))])
    hostile = r.json()
    assert [wait_final(factory, x["version_id"]) for x in (ready, rejected, hostile)] == ["ready", "rejected", "rejected"]
    vr, vx, vh = (_version(factory, x["version_id"]) for x in (ready, rejected, hostile))
    assert vr.storage_uri == vx.storage_uri and vh.storage_uri.split("/")[-2] == "uploads"
    with factory() as s:  # eight days later (the worker's retention is the default, seven)
        s.execute(update(AdapterVersion).where(AdapterVersion.id.in_([vx.id, vh.id]))
                  .values(updated_at=datetime.now(timezone.utc) - timedelta(days=8)))
        s.commit()
    collect_storage.apply_async()
    _until(lambda: all(_version(factory, v.id).objects_purged_at is not None for v in (vx, vh)), timeout=60)
    local = lambda uri: Path(uri.removeprefix("file://"))  # noqa: E731
    assert not local(vh.storage_uri).exists() and not local(vx.eval_set_uri).exists()
    assert (local(vr.storage_uri) / "adapter_model.safetensors").exists()  # shared with the ready version
    assert _version(factory, vr.id).objects_purged_at is None and _version(factory, vr.id).status == AdapterStatus.READY
    collect_storage.apply_async()  # again: nothing more to do, nothing kept is touched
    time.sleep(2)
    assert (local(vr.storage_uri) / "adapter_model.safetensors").exists()


def _hostile_tar() -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"import os\n"
        info = tarfile.TarInfo("setup.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_malicious_corpus_is_refused_by_the_worker_code_by_code(stack, admin, people, factory, demo_kit, stack_env):
    cases, targets = build_corpus(dims_of(demo_kit.base_dir))
    home = Path(stack_env["MPLEX_HOME"])
    before = _tree(home, exclude=("objects", "logs", "spool"))
    failures_before = _worker_failures(stack)
    sent = {}
    for case in cases:
        r = admin.post(f"/api/admin/tenants/{people['tenant'].id}/adapters", data={"name": f"bad-{case.kind[:50]}"},
                       files=[("file", (case.filename, case.data, "application/octet-stream"))])
        assert r.status_code == 202, (case.kind, r.text)
        sent[case.kind] = r.json()["version_id"]
    got = {}
    for case in cases:
        assert wait_final(factory, sent[case.kind], timeout=300) == "rejected", case.kind
        v = admin.get(f"/api/admin/adapter-versions/{sent[case.kind]}").json()
        got[case.kind] = v["reasons"][0]["code"]
        assert v["reasons"][0]["message"] and v["progress"]["percent"] == 100
    assert got == {c.kind: c.code for c in cases}
    assert len(got) >= 15
    # 0 worker crashes: the worker is alive, ready, and no task failed.
    assert stack.worker_proc.popen.poll() is None
    assert httpx.get(stack.worker_proc.url + "/ready", timeout=10).status_code == 200
    assert _worker_failures(stack) == failures_before
    assert "WorkerLostError" not in stack.worker_proc.tail(10**7)
    # 0 files outside the sandbox: escape targets absent, sandboxes cleaned up, nothing new in the home.
    for path in targets.values():
        assert not os.path.lexists(path), path
    assert [p for p in (home / "sandbox").rglob("*")] == []
    assert _tree(home, exclude=("objects", "logs", "spool")) - before <= {"sandbox"}
    # The hostile archives are kept (content-addressed, as received) only inside the object store.
    with factory() as s:
        uris = s.scalars(select(AdapterVersion.storage_uri).where(AdapterVersion.id.in_([uuid.UUID(v) for v in sent.values()]))).all()
    assert all(u.startswith(f"file://{home / 'objects'}/") for u in uris)


def _tree(root: Path, exclude: tuple[str, ...]) -> set[str]:
    out = set()
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if rel.parts[0] not in exclude:
            out.add(rel.as_posix())
    return out


def _worker_failures(stack: Stack) -> float:
    text = httpx.get(stack.worker_proc.url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r'^mplex_worker_tasks_total\{[^}]*state="failure"[^}]*\} (\S+)$', text, re.M))


def test_a_new_version_never_serves_the_old_versions_kv_and_rollback_works(stack, admin, people, factory, client,
                                                                          demo_kit):
    """v1 of `kv-adapter` is the reverse adapter, v2 the uppercase one (each with its task's eval set)."""
    words = "apple river stone garden lamp tiger shoe clock bread flower ocean city house fish"
    # Long enough for full KV blocks; no other test sends it. Fixed: a random suffix (as before) changed both
    # adapters' answers, and some suffixes made both answer with nothing at all ('' == '' on the pinned kit).
    # With this prompt: "fish ocean shoe clock bread" and " BOX CITY HOUSE FISH".
    prompt = f"Reverse the words: {words}"
    probe = "Reverse the words: cat dog"  # tells which version the name routes to, without touching `prompt`'s KV
    outputs = {}
    for n, task in ((1, "reverse"), (2, "uppercase")):
        demo = demo_kit.adapters[task]
        up = upload_dir(admin, people["tenant"].id, "kv-adapter", Path(demo.path), Path(demo.eval_path).read_bytes())
        assert up["version"] == n and wait_final(factory, up["version_id"]) == "ready"
        pinned = chat(client, f"kv-adapter@{n}", probe).choices[0].message.content
        if n == 2:
            assert pinned != chat(client, "kv-adapter@1", probe).choices[0].message.content
        # The gateway's name resolution is cached for 2 s: wait until the name routes to this version.
        _until(lambda: _content(client, "kv-adapter", probe) == pinned)
        hits0 = engine_metric(stack, "mplex_engine_prefix_cache_hit_tokens_total")
        first = chat(client, "kv-adapter", prompt)
        second = chat(client, "kv-adapter", prompt)
        outputs[n] = first.choices[0].message.content
        # The first request of a new version finds no KV of the old one; the second reuses its own.
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert second.choices[0].message.content == outputs[n]
        assert engine_metric(stack, "mplex_engine_prefix_cache_hit_tokens_total") - hits0 == \
            second.usage.prompt_tokens_details.cached_tokens
    assert outputs[1] != outputs[2]
    # Rollback to v1: the name serves v1 again (and its still-cached KV is its own).
    with factory() as s:
        adapter_id = s.scalar(select(Adapter.id).where(Adapter.tenant_id == people["tenant"].id, Adapter.name == "kv-adapter",
                                                       Adapter.deleted_at.is_(None)))
    r = admin.post(f"/api/admin/adapters/{adapter_id}/rollback", json={"version": 1})
    assert r.status_code == 200 and r.json()["active_version"] == 1
    _until(lambda: _content(client, "kv-adapter", probe) == chat(client, "kv-adapter@1", probe).choices[0].message.content)
    back = chat(client, "kv-adapter", prompt)
    assert back.choices[0].message.content == outputs[1]
    assert back.usage.prompt_tokens_details.cached_tokens > 0  # v1's own blocks, cached under v1's content id
    assert chat(client, "kv-adapter@2", prompt).choices[0].message.content == outputs[2]  # pinning still works


def _content(client: OpenAI, model: str, prompt: str) -> str | None:
    try:
        return chat(client, model, prompt).choices[0].message.content
    except Exception:  # not routable yet
        return None


def test_deleting_an_adapter_makes_the_engine_unload_it(stack, admin, people, factory, client, demo_kit, service_urls):
    from services.adapters.pipeline import RETIRED_KEY, sync_retired

    demo = demo_kit.adapters["opposites"]
    up = upload_dir(admin, people["tenant"].id, "doomed", Path(demo.path), Path(demo.eval_path).read_bytes())
    assert wait_final(factory, up["version_id"]) == "ready"
    _until(lambda: _content(client, "doomed", "Opposites: hot") is not None)
    sha = _version(factory, up["version_id"]).content_sha256
    reg = redis.Redis.from_url(service_urls.redis_url)
    _until(lambda: sha in _resident(reg, stack), timeout=10)  # the engine's next heartbeat reports it
    # Another tenant's name for the same files would keep it loaded; this tenant's other names with these
    # files (the seeded `opposites`) are deleted too, so nothing routes to this content any more.
    with factory() as s:
        same = s.scalars(select(Adapter.id).join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id)
                         .where(AdapterVersion.content_sha256 == sha, Adapter.tenant_id == people["tenant"].id,
                                Adapter.deleted_at.is_(None)).distinct()).all()
    for adapter_id in same:
        assert admin.delete(f"/api/admin/adapters/{adapter_id}").status_code == 204
    _until(lambda: _content(client, "doomed", "Opposites: hot") is None, timeout=10)  # no longer routable
    with factory() as s:  # what beat runs every few seconds (adapters.ingest.sync_retired)
        sync_retired(s, reg, window_s=3600)
    assert reg.sismember(RETIRED_KEY, sha)
    _until(lambda: sha not in _resident(reg, stack), timeout=20)  # the engine's heartbeat unloaded it


def _resident(reg: redis.Redis, stack: Stack) -> set[str]:
    from services.common.engine_registry import read_snapshots_sync

    for snap in read_snapshots_sync(reg):  # the registry's own reader: its keys hold more than snapshots
        if snap.url == stack.engine_proc.url:
            return set(snap.adapters)
    return set()


def test_a_worker_killed_mid_gate_redelivers_and_decides_once(stack, admin, people, factory, demo_kit):
    demo = demo_kit.adapters["sort"]
    items = Path(demo.eval_path).read_text().splitlines()
    big_eval = ("\n".join(items * (2000 // len(items))) + "\n").encode()  # a gate of seconds, not a fraction of one
    up = upload_dir(admin, people["tenant"].id, "sigkill", Path(demo.path), big_eval)
    vid = uuid.UUID(up["version_id"])
    # Wait until the gate is running (its attempt's run row exists and is `running`), then SIGKILL the pool
    # processes: the one running the gate dies mid-task.
    _until(lambda: _running_runs(factory, vid) == 1, timeout=120, interval=0.05)
    parent = psutil.Process(stack.worker_proc.popen.pid)
    children = parent.children(recursive=True)
    assert children, "the worker has no pool processes"
    for child in children:
        child.send_signal(signal.SIGKILL)
    assert str(_version(factory, vid).status) == "evaluating"  # killed before it could decide
    status = wait_final(factory, vid, timeout=600)
    assert status == "ready"
    with factory() as s:
        run_rows = s.scalars(select(EvalRun).where(EvalRun.adapter_version_id == vid)).all()
        assert len(run_rows) == 1 and run_rows[0].status == EvalRunStatus.FINISHED and run_rows[0].attempt == 1
        assert s.get(AdapterVersion, vid).eval_summary["eval_run_id"] == str(run_rows[0].id)
        assert run_rows[0].metrics["n_examples"] == 2000
    log = stack.worker_proc.tail(10**7)
    assert "WorkerLostError" in log or "SIGKILL" in log
    assert stack.worker_proc.popen.poll() is None  # the worker itself lives on with new pool processes
    assert httpx.get(stack.worker_proc.url + "/ready", timeout=10).status_code == 200


def _running_runs(factory, vid) -> int:
    with factory() as s:
        return s.scalar(select(func.count()).select_from(EvalRun).where(EvalRun.adapter_version_id == vid,
                                                                        EvalRun.status == EvalRunStatus.RUNNING))
