"""The adapter lifecycle end to end on real processes — an engine, the gateway and a Celery worker (`mplex ...`
subprocesses on the test Postgres and Redis), with the tiny random base model:

- an adapter that wins its eval set goes uploaded -> ready and is served by name through the gateway (OpenAI
  SDK), token for token what the engine itself answers;
- the malicious corpus is refused case by case with its code; the worker never crashes; nothing is written
  outside the sandbox;
- a new version of a name never serves the old version's KV; rollback serves the old one again; deleting the
  adapter makes the engine unload it;
- the worker process running the gate is SIGKILLed: the task is redelivered and the version ends in one
  final state with one eval run.
"""
from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from openai import OpenAI
from sqlalchemy import func, select

from services.common.db import make_sessionmaker
from services.common.models import Adapter, AdapterStatus, AdapterVersion, EvalRun, EvalRunStatus, Role
from tests.adapters.corpus import build_corpus
from tests.adapters.helpers import eval_jsonl, greedy_texts, wait_final
from tests.adapters.tinymodel import WORDS, write_adapter
from tests.factories import DEFAULT_PASSWORD, make_api_key, make_tenant, make_user
from tests.gateway.mgmt_harness import Api
from tests.stack import Stack

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPTS = [" ".join(WORDS[i:i + 3]) for i in range(0, 24, 3)]
GATE_ENV = {"MPLEX_ADAPTERS_MAX_EXAMPLES": "8", "MPLEX_ADAPTERS_MAX_NEW_TOKENS": "8", "MPLEX_ADAPTERS_LATENCY_SAMPLES": "1"}


@pytest.fixture(scope="module")
def stack(stack_env, tiny_base, tmp_path_factory, service_urls):
    _purge_adapter_queues(service_urls.broker_url)
    env = {"MPLEX_BASE_MODEL_DIR": str(tiny_base), "MPLEX_BASE_MODEL_NAME": MODEL, **GATE_ENV}
    s = Stack({**stack_env, **env}, tmp_path_factory.mktemp("adapter-stack-logs"))
    try:
        s.engine_proc = s.engine(tiny_base, MODEL, f"adapters-eng-{os.getpid()}", kv_mb=32, max_loras=4)
        s.gw = s.gateway(tiny_base, MODEL)
        s.worker_proc = s.worker("adapters.ingest,adapters.eval")
        yield s
    finally:
        s.close()


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
                "key": make_api_key(db, tenant=tenant).secret}


@pytest.fixture
def admin(stack, people):
    api = Api(stack.gw.url)
    assert api.login(people["admin"].email, DEFAULT_PASSWORD).status_code == 200
    yield api
    api.close()


@pytest.fixture(scope="module")
def factory(db_engine):
    return make_sessionmaker(db_engine)


def upload_dir(api: Api, tenant_id, name: str, adapter_dir: Path, eval_set: bytes | None = None, **form) -> dict:
    files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in sorted(adapter_dir.iterdir())]
    if eval_set is not None:
        files.append(("eval_set", ("eval.jsonl", eval_set, "application/jsonl")))
    r = api.post(f"/api/admin/tenants/{tenant_id}/adapters", data={"name": name, **{k: str(v) for k, v in form.items()}},
                 files=files)
    assert r.status_code == 202, r.text
    return r.json()


def engine_metric(stack: Stack, name: str) -> float:
    text = httpx.get(f"{stack.engine_proc.url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def chat(client: OpenAI, model: str, prompt: str):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                          temperature=0)


@pytest.fixture(scope="module")
def winner(tiny_base, tiny_dims, tmp_path_factory):
    d = write_adapter(tmp_path_factory.mktemp("e2e") / "winner", tiny_dims, rank=8,
                      targets=("q_proj", "k_proj", "v_proj", "o_proj"), b_std=0.4, seed=11)
    return d, eval_jsonl(PROMPTS, greedy_texts(tiny_base, PROMPTS, adapter_dir=d))


def test_an_adapter_goes_ready_and_is_served_by_name_exactly_as_the_engine_serves_it(stack, admin, people, factory, winner):
    adapter_dir, eval_set = winner
    up = upload_dir(admin, people["tenant"].id, "e2e-winner", adapter_dir, eval_set, min_margin=0.3, min_fp8_agreement=0.0)
    seen = set()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the progress the UI polls
        v = admin.get(f"/api/admin/adapter-versions/{up['version_id']}").json()
        seen.add(v["status"])
        if v["status"] in ("ready", "rejected"):
            break
        time.sleep(0.2)
    assert v["status"] == "ready", v
    assert seen <= {"uploaded", "validating", "evaluating", "ready"}
    assert v["progress"] == {"percent": 100, "step": "ready"} and v["eval"]["passed"] is True
    assert v["rank"] == 8 and v["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]

    client = OpenAI(base_url=f"{stack.gw.url}/v1", api_key=people["key"], max_retries=0)
    assert "e2e-winner" in [m.id for m in client.models.list().data]
    via_gateway = [chat(client, "e2e-winner", p).choices[0].message.content for p in PROMPTS[:4]]
    # The engine's own answer for the same adapter files, loaded directly from the object store.
    r = httpx.post(f"{stack.engine_proc.url}/internal/v1/adapters", timeout=60,
                   json={"name": "direct-winner", "path": _version(factory, up["version_id"]).storage_uri,
                         "content_id": v["content_sha256"]})
    assert r.status_code == 200, r.text
    direct = OpenAI(base_url=f"{stack.engine_proc.url}/v1", api_key="unused", max_retries=0)
    assert via_gateway == [chat(direct, "direct-winner", p).choices[0].message.content for p in PROMPTS[:4]]
    # ... and not what the base model says.
    assert via_gateway != [chat(client, MODEL, p).choices[0].message.content for p in PROMPTS[:4]]


def _version(factory, version_id) -> AdapterVersion:
    with factory() as s:
        return s.get(AdapterVersion, uuid.UUID(str(version_id)))


def test_the_malicious_corpus_is_refused_by_the_worker_code_by_code(stack, admin, people, factory, tiny_dims, stack_env):
    cases, targets = build_corpus(tiny_dims)
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


def test_a_new_version_never_serves_the_old_versions_kv_and_rollback_works(stack, admin, people, factory, tiny_base,
                                                                          tiny_dims, tmp_path):
    client = OpenAI(base_url=f"{stack.gw.url}/v1", api_key=people["key"], max_retries=0)
    prompt = "apple banana cat dog sun moon tree river house book car bird fish star cloud rain snow stone music"
    probe = "red green blue boat train road"  # tells which version the name routes to, without touching `prompt`'s KV
    outputs = {}
    for n, seed in ((1, 21), (2, 22)):
        d = write_adapter(tmp_path / f"kv{n}", tiny_dims, rank=4, targets=("q_proj", "v_proj"), b_std=0.5, seed=seed)
        up = upload_dir(admin, people["tenant"].id, "kv-adapter", d, eval_jsonl(PROMPTS, greedy_texts(tiny_base, PROMPTS, adapter_dir=d)),
                        min_margin=-1.0, min_fp8_agreement=0.0)
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
        adapter_id = s.scalar(select(Adapter.id).where(Adapter.tenant_id == people["tenant"].id, Adapter.name == "kv-adapter"))
    r = admin.post(f"/api/admin/adapters/{adapter_id}/rollback", json={"version": 1})
    assert r.status_code == 200 and r.json()["active_version"] == 1
    back = chat(client, "kv-adapter", prompt)
    assert back.choices[0].message.content == outputs[1]
    assert back.usage.prompt_tokens_details.cached_tokens > 0  # v1's own blocks, cached under v1's content id
    assert chat(client, "kv-adapter@2", prompt).choices[0].message.content == outputs[2]  # pinning still works


def _content(client: OpenAI, model: str, prompt: str) -> str | None:
    try:
        return chat(client, model, prompt).choices[0].message.content
    except Exception:  # not routable yet
        return None


def _until(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError("condition not met in time")


def test_deleting_an_adapter_makes_the_engine_unload_it(stack, admin, people, factory, tiny_base, tiny_dims, tmp_path,
                                                       service_urls):
    from services.adapters.pipeline import RETIRED_KEY, sync_retired

    d = write_adapter(tmp_path / "doomed", tiny_dims, rank=4, b_std=0.5, seed=int(time.time()) % 1000 + 100)
    up = upload_dir(admin, people["tenant"].id, "doomed", d, eval_jsonl(PROMPTS, greedy_texts(tiny_base, PROMPTS, adapter_dir=d)),
                    min_margin=-1.0, min_fp8_agreement=0.0)
    assert wait_final(factory, up["version_id"]) == "ready"
    client = OpenAI(base_url=f"{stack.gw.url}/v1", api_key=people["key"], max_retries=0)
    _until(lambda: _ok(lambda: chat(client, "doomed", "apple")))
    sha = _version(factory, up["version_id"]).content_sha256
    reg = redis.Redis.from_url(service_urls.redis_url)
    assert sha in _resident(reg, stack)
    assert admin.delete(f"/api/admin/adapters/{up['adapter_id']}").status_code == 204
    with factory() as s:  # what beat runs every few seconds (adapters.ingest.sync_retired)
        sync_retired(s, reg, window_s=3600)
    assert reg.sismember(RETIRED_KEY, sha)
    _until(lambda: sha not in _resident(reg, stack), timeout=20)  # the engine's heartbeat unloaded it


def _ok(fn) -> bool:
    try:
        fn()
        return True
    except Exception:
        return False


def _resident(reg: redis.Redis, stack: Stack) -> set[str]:
    import json

    for key in reg.scan_iter("mplex:engine:*"):
        raw = reg.get(key)
        if raw:
            snap = json.loads(raw)
            if snap.get("url") == stack.engine_proc.url:
                return set(snap.get("host_adapters", [])) | set(snap.get("slot_adapters", []))
    return set()


def test_a_worker_killed_mid_gate_redelivers_and_decides_once(stack, admin, people, factory, tiny_base, tiny_dims, tmp_path):
    d = write_adapter(tmp_path / "killed", tiny_dims, rank=8, b_std=0.4, seed=31)
    up = upload_dir(admin, people["tenant"].id, "sigkill", d, eval_jsonl(PROMPTS, ["x"] * len(PROMPTS)),
                    min_margin=-1.0, min_fp8_agreement=0.0)
    vid = uuid.UUID(up["version_id"])
    # Wait until the gate is running (its attempt's run row exists and is `running`), then SIGKILL the pool
    # processes: the one running the gate dies mid-task.
    _until(lambda: _running_runs(factory, vid) == 1, timeout=120)
    parent = psutil.Process(stack.worker_proc.popen.pid)
    children = parent.children(recursive=True)
    assert children, "the worker has no pool processes"
    for child in children:
        child.send_signal(signal.SIGKILL)
    status = wait_final(factory, vid, timeout=600)
    assert status in ("ready", "rejected")
    with factory() as s:
        run_rows = s.scalars(select(EvalRun).where(EvalRun.adapter_version_id == vid)).all()
        assert len(run_rows) == 1 and run_rows[0].status == EvalRunStatus.FINISHED and run_rows[0].attempt == 1
        assert s.get(AdapterVersion, vid).eval_summary["eval_run_id"] == str(run_rows[0].id)
    assert "WorkerLostError" in stack.worker_proc.tail(10**7) or "SIGKILL" in stack.worker_proc.tail(10**7)
    assert stack.worker_proc.popen.poll() is None  # the worker itself lives on with new pool processes


def _running_runs(factory, vid) -> int:
    with factory() as s:
        return s.scalar(select(func.count()).select_from(EvalRun).where(EvalRun.adapter_version_id == vid,
                                                                        EvalRun.status == EvalRunStatus.RUNNING))
