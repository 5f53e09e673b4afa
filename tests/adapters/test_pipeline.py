"""The pipeline's plain functions on real Postgres and Redis, with the tiny base model: a good adapter goes
uploaded -> validating -> evaluating -> ready and becomes active; one that does not beat the base is rejected
with reasons; every step is idempotent; a broken gate run is retried as new attempts and then rejected;
deleted adapters' content ids reach the retired set; lost tasks are swept up."""
from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select, update

from services.adapters.config import GateDefaults, PipelineConfig
from services.adapters.pipeline import (
    RETIRED_KEY,
    abandon,
    count_delivery,
    load_eval_items,
    evaluate_version,
    ingest_version,
    sweep_stalled,
    sync_retired,
)
from services.adapters.base_model import ensure_base_model
from services.adapters.storage import files_sha256
from services.common.lora_format import content_id
from services.adapters.upload import pack_dir, upload_adapter
from services.common.models import (
    Adapter,
    AdapterStatus,
    AdapterVersion,
    AuditLog,
    EvalRun,
    EvalRunStatus,
    GateDecision,
)
from services.gateway import crud
from tests.adapters.corpus import adapter_tar, good_config, good_weights
from tests.adapters.helpers import ACTOR, eval_jsonl, greedy_texts, runs, upload, version
from tests.adapters.tinymodel import WORDS, write_adapter
from tests.factories import make_tenant

PROMPTS = [" ".join(WORDS[i:i + 3]) for i in range(0, 24, 3)]


@pytest.fixture(scope="module")
def tiny_adapters(tiny_base, tiny_dims, tmp_path_factory):
    """A strong adapter, and eval sets on which it does (and does not) beat the base."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    strong = write_adapter(root / "strong", tiny_dims, rank=8, targets=("q_proj", "v_proj", "down_proj"), b_std=0.4, seed=7)
    with_adapter = greedy_texts(tiny_base, PROMPTS, adapter_dir=strong)
    base_only = greedy_texts(tiny_base, PROMPTS)
    assert with_adapter != base_only  # the adapter changes what the model says
    return {"strong": strong, "wins": eval_jsonl(PROMPTS, with_adapter), "loses": eval_jsonl(PROMPTS, base_only)}


def test_a_good_adapter_becomes_ready_and_active(runtime, db, tiny_adapters):
    tenant = make_tenant(db)
    r = upload(runtime, tenant, "strong", tiny_adapters["strong"], eval_set=tiny_adapters["wins"], min_margin=0.3,
               min_fp8_agreement=0.0)
    v = version(runtime, r.version_id)
    assert (v.status, v.version, v.progress_percent) == (AdapterStatus.UPLOADED, 1, 0)
    assert v.storage_uri == runtime.store.uri(f"adapters/{files_sha256(tiny_adapters['strong'])}")
    assert v.content_sha256 == content_id(tiny_adapters["strong"])
    assert v.gate_config == {"metric": "rouge_l", "min_margin": 0.3, "min_fp8_agreement": 0.0, "max_regression": 0.05,
                             "regression_confidence": 0.95, "max_malformed_rate": 0.02}

    runtime.enqueue.ingest(r.version_id)  # validation, then (inline) the gate
    v = version(runtime, r.version_id)
    assert v.status == AdapterStatus.READY, v.status_reasons
    assert (v.rank, v.alpha, v.target_modules) == (8, 16.0, ["q_proj", "v_proj", "down_proj"])
    assert v.progress_percent == 100 and v.ready_at is not None and v.status_reasons == []
    (run,) = runs(runtime, r.version_id)
    assert (run.attempt, run.status, run.decision) == (1, EvalRunStatus.FINISHED, GateDecision.PASS)
    m = run.metrics
    assert m["adapter"]["rouge_l"] - m["base"]["rouge_l"] >= 0.3
    assert m["full_precision"]["exact_match"] == 1.0  # the eval set is this adapter's own full-precision output
    assert 0 <= m["fp8_token_agreement"] <= 1 and m["served_weight_dtype"] == "fp8" and m["eval_set"] == "tenant"
    assert m["latency"]["adapter_ms_per_token"] > 0 and m["n_examples"] == len(PROMPTS)
    assert len(run.examples) == len(PROMPTS) and set(run.examples[0]) >= {"prompt", "expected", "adapter", "base"}
    assert v.eval_summary["passed"] is True and v.eval_summary["eval_run_id"] == str(run.id)
    with runtime.session_factory() as s:
        assert s.get(Adapter, r.adapter_id).active_version_id == r.version_id
        audit = s.scalars(select(AuditLog.action).where(AuditLog.tenant_id == tenant.id)).all()
    assert sorted(audit) == ["adapter.create", "adapter.upload"]


def test_an_adapter_that_does_not_beat_the_base_is_rejected_with_reasons(runtime, db, tiny_adapters):
    tenant = make_tenant(db)
    r = upload(runtime, tenant, "loser", tiny_adapters["strong"], eval_set=tiny_adapters["loses"], min_fp8_agreement=0.0)
    runtime.enqueue.ingest(r.version_id)
    v = version(runtime, r.version_id)
    assert v.status == AdapterStatus.REJECTED
    assert [x["code"] for x in v.status_reasons] == ["margin_below_threshold"]
    assert "must beat the base" in v.status_reasons[0]["message"]
    (run,) = runs(runtime, r.version_id)
    assert run.decision == GateDecision.FAIL and run.metrics["base"]["rouge_l"] > run.metrics["adapter"]["rouge_l"]
    assert {x["code"]: x["passed"] for x in run.reasons} == {"margin_below_threshold": False, "well_formed_ok": True,
                                                            "logits_ok": True, "fp8_agreement_ok": True}
    with runtime.session_factory() as s:
        assert s.get(Adapter, r.adapter_id).active_version_id is None  # nothing routable


def test_fp8_disagreement_alone_rejects(runtime, db, tiny_adapters):
    tenant = make_tenant(db)
    r = upload(runtime, tenant, "strict", tiny_adapters["strong"], eval_set=tiny_adapters["wins"], min_margin=0.0,
               min_fp8_agreement=1.0)
    runtime.enqueue.ingest(r.version_id)
    v = version(runtime, r.version_id)
    (run,) = runs(runtime, r.version_id)
    if run.metrics["fp8_token_agreement"] < 1.0:  # the tiny random base is far from FP8-exact
        assert v.status == AdapterStatus.REJECTED
        assert [x["code"] for x in v.status_reasons] == ["fp8_agreement_below_threshold"]
    else:
        assert v.status == AdapterStatus.READY


def test_outputs_postgres_cannot_store_as_text_are_stored_escaped(runtime, db, tiny_adapters):
    """JSONB refuses U+0000, which a model's output or an eval set's `expected` may hold: the verdict is still
    recorded (once stuck as `evaluating` after a DataError), with U+FFFD in its place."""
    from dataclasses import replace

    # The tiny random model's outputs hold stray partial UTF-8 bytes; this test is about storing NUL, not about
    # well-formedness, so that check is relaxed here (thresholds are stored on the version at upload).
    runtime.config = replace(runtime.config, gate=replace(runtime.config.gate, max_malformed_rate=1.0))
    tenant = make_tenant(db)
    nul_set = eval_jsonl(PROMPTS, [f"{p}\x00tail" for p in PROMPTS])
    r = upload(runtime, tenant, "nul", tiny_adapters["strong"], eval_set=nul_set, min_margin=-1.0, min_fp8_agreement=0.0)
    runtime.enqueue.ingest(r.version_id)
    v = version(runtime, r.version_id)
    assert v.status == AdapterStatus.READY, v.status_reasons
    (run,) = runs(runtime, r.version_id)
    assert run.status == EvalRunStatus.FINISHED and run.examples[0]["expected"] == f"{PROMPTS[0]}\ufffdtail"
    assert v.eval_summary["examples"][0]["expected"] == f"{PROMPTS[0]}\ufffdtail"


def test_every_step_is_idempotent(runtime, db, tiny_adapters):
    tenant = make_tenant(db)
    r = upload(runtime, tenant, "twice", tiny_adapters["strong"], eval_set=tiny_adapters["wins"], min_margin=0.3,
               min_fp8_agreement=0.0)
    runtime.enqueue = _Recorder()  # stop after each step to replay it
    assert ingest_version(runtime, r.version_id).action == "validated"
    assert version(runtime, r.version_id).status == AdapterStatus.EVALUATING
    # A redelivered ingest does not validate again; it re-sends the gate in case that message was lost.
    again = ingest_version(runtime, r.version_id)
    assert (again.status, again.action) == ("evaluating", "requeued_eval")
    assert runtime.enqueue.calls == [("evaluate", r.version_id, 1), ("evaluate", r.version_id, 1)]
    first = evaluate_version(runtime, r.version_id, 1)
    assert (first.status, first.action) == ("ready", "decided")
    ready_at = version(runtime, r.version_id).ready_at
    for _ in range(2):
        assert evaluate_version(runtime, r.version_id, 1).action == "noop"
        assert ingest_version(runtime, r.version_id).action == "noop"
    assert len(runs(runtime, r.version_id)) == 1 and version(runtime, r.version_id).ready_at == ready_at


def test_a_redelivered_gate_reuses_its_attempts_run(runtime, db, tiny_adapters):
    """A worker died mid-gate: the run row it left `running` is reused by the redelivered task."""
    tenant = make_tenant(db)
    r = upload(runtime, tenant, "redelivered", tiny_adapters["strong"], eval_set=tiny_adapters["wins"], min_margin=0.3,
               min_fp8_agreement=0.0)
    runtime.enqueue = _Recorder()
    ingest_version(runtime, r.version_id)
    with runtime.session_factory() as s:  # what a killed worker leaves behind
        s.add(EvalRun(adapter_version_id=r.version_id, attempt=1, status=EvalRunStatus.RUNNING, task_id="dead-task"))
        s.commit()
    out = evaluate_version(runtime, r.version_id, 1, task_id="redelivered-task")
    assert out.status == "ready"
    (run,) = runs(runtime, r.version_id)
    assert (run.status, run.task_id) == (EvalRunStatus.FINISHED, "redelivered-task")


def test_a_message_that_keeps_killing_its_worker_is_refused_not_redelivered_forever(runtime, db, tiny_adapters):
    """What services.adapters.tasks does on each start of a message: count it; past max_deliveries (the
    worker process died under it every time: OOM, a native crash) the version is refused with a reason."""
    tenant = make_tenant(db)
    r = upload(runtime, tenant, "poison", tiny_adapters["strong"], eval_set=tiny_adapters["wins"])
    runtime.enqueue = _Recorder()
    ingest_version(runtime, r.version_id)
    with runtime.session_factory() as s:  # the gate's worker died mid-run
        s.add(EvalRun(adapter_version_id=r.version_id, attempt=1, status=EvalRunStatus.RUNNING, task_id="t"))
        s.commit()
    delivery = f"poison-{uuid.uuid4().hex}:0"
    counts = [count_delivery(runtime, delivery) for _ in range(runtime.config.max_deliveries + 1)]
    assert counts == list(range(1, runtime.config.max_deliveries + 2))
    assert count_delivery(runtime, f"{delivery[:-2]}:1") == 1  # a retry of the task is a new message
    out = abandon(runtime, r.version_id, counts[-1])
    v = version(runtime, r.version_id)
    assert (out.status, v.status) == ("rejected", AdapterStatus.REJECTED)
    assert [x["code"] for x in v.status_reasons] == ["worker_lost"]
    assert [(x.status, x.reasons[0]["code"]) for x in runs(runtime, r.version_id)] == [(EvalRunStatus.FAILED, "worker_lost")]


def test_a_broken_gate_run_is_retried_then_rejected(runtime, db, tiny_adapters):
    """The gate cannot run (its eval set vanished from storage): each attempt is recorded as failed, a new
    attempt follows, and after max_eval_attempts the version is rejected saying why."""
    tenant = make_tenant(db)
    r = upload(runtime, tenant, "broken", tiny_adapters["strong"], eval_set=tiny_adapters["wins"])
    v = version(runtime, r.version_id)
    (Path(runtime.store.root) / runtime.store.key_of(v.eval_set_uri)).unlink()
    runtime.enqueue.ingest(r.version_id)
    v = version(runtime, r.version_id)
    assert v.status == AdapterStatus.REJECTED and [x["code"] for x in v.status_reasons] == ["eval_failed"]
    assert [(x.attempt, x.status, x.decision) for x in runs(runtime, r.version_id)] == \
        [(a, EvalRunStatus.FAILED, None) for a in range(1, runtime.config.max_eval_attempts + 1)]


def test_an_upload_that_cannot_be_identified_is_refused_by_the_pipeline(runtime, db, tiny_dims):
    tenant = make_tenant(db)
    data = adapter_tar(good_config(auto_map={"AutoModel": "x.Y"}), good_weights(tiny_dims))
    r = upload(runtime, tenant, "hostile", data=data)
    v = version(runtime, r.version_id)
    assert runtime.store.key_of(v.storage_uri).startswith("uploads/")  # stored as received, for the record
    runtime.enqueue.ingest(r.version_id)
    v = version(runtime, r.version_id)
    assert v.status == AdapterStatus.REJECTED and [x["code"] for x in v.status_reasons] == ["custom_code"]
    assert runs(runtime, r.version_id) == [] and v.rank is None


def test_versions_number_up_and_the_newest_ready_one_is_active(runtime, db, tiny_adapters, tiny_dims, tmp_path):
    tenant = make_tenant(db)
    first = upload(runtime, tenant, "series", tiny_adapters["strong"], eval_set=tiny_adapters["wins"], min_margin=0.3,
                   min_fp8_agreement=0.0)
    runtime.enqueue.ingest(first.version_id)
    other = write_adapter(tmp_path / "other", tiny_dims, rank=8, targets=("q_proj", "v_proj", "down_proj"), b_std=0.4, seed=7,
                          alpha=17)  # same weights, another alpha: another content id
    second = upload(runtime, tenant, "series", other, eval_set=tiny_adapters["wins"], min_margin=-1.0,
                    min_fp8_agreement=0.0)
    assert (first.version, second.version) == (1, 2) and first.adapter_id == second.adapter_id
    runtime.enqueue.ingest(second.version_id)
    with runtime.session_factory() as s:
        assert s.get(Adapter, first.adapter_id).active_version_id == second.version_id


def test_deleted_adapters_reach_the_retired_set(runtime, db, tiny_adapters, tiny_dims, service_urls, tmp_path):
    a, b = make_tenant(db), make_tenant(db)
    unique = write_adapter(tmp_path / "unique", tiny_dims, rank=4, seed=int(uuid.uuid4().int % 10_000))
    ra = upload(runtime, a, "shared", unique, eval_set=tiny_adapters["wins"], min_margin=-1.0, min_fp8_agreement=0.0)
    rb = upload(runtime, b, "shared", unique, eval_set=tiny_adapters["wins"], min_margin=-1.0, min_fp8_agreement=0.0)
    for r in (ra, rb):
        runtime.enqueue.ingest(r.version_id)
    assert ra.content_sha256 == rb.content_sha256  # same files, two tenants
    client = redis.Redis.from_url(service_urls.redis_url)
    with runtime.session_factory() as s:
        crud.delete_adapter(s, adapter_id=ra.adapter_id, actor=ACTOR)
        s.commit()
        assert ra.content_sha256 not in sync_retired(s, client, window_s=600).content_ids  # b still serves it
        crud.delete_adapter(s, adapter_id=rb.adapter_id, actor=ACTOR)
        s.commit()
        assert ra.content_sha256 in sync_retired(s, client, window_s=600).content_ids
    assert client.sismember(RETIRED_KEY, ra.content_sha256)
    assert 0 < client.ttl(RETIRED_KEY) <= 600
    # The same content made ready again (a new upload) leaves the set at once.
    c = make_tenant(db)
    rc = upload(runtime, c, "again", unique, eval_set=tiny_adapters["wins"], min_margin=-1.0, min_fp8_agreement=0.0)
    runtime.enqueue.ingest(rc.version_id)
    assert not client.sismember(RETIRED_KEY, ra.content_sha256)


def test_the_sweep_restarts_versions_whose_task_was_lost(runtime, db, tiny_adapters):
    tenant = make_tenant(db)
    r = upload(runtime, tenant, "lost", tiny_adapters["strong"], eval_set=tiny_adapters["wins"], min_margin=0.3,
               min_fp8_agreement=0.0)
    assert r.version_id not in [v for v, _ in sweep_stalled(runtime, older_than_s=600)]  # fresh: left alone
    with runtime.session_factory() as s:  # the broker was down at upload: nothing happened for a long time
        s.execute(update(AdapterVersion).where(AdapterVersion.id == r.version_id)
                  .values(updated_at=datetime.now(timezone.utc) - timedelta(hours=1)))
        s.commit()
    assert (r.version_id, "ingest") in sweep_stalled(runtime, older_than_s=600)
    assert version(runtime, r.version_id).status == AdapterStatus.READY


class _Recorder:
    def __init__(self):
        self.calls = []

    def ingest(self, version_id):
        self.calls.append(("ingest", version_id, None))

    def evaluate(self, version_id, attempt, countdown=0):
        self.calls.append(("evaluate", version_id, attempt))


def test_reupload_with_reuse_returns_the_same_version(runtime, db, tiny_adapters):
    tenant = make_tenant(db)
    with runtime.session_factory() as s:
        n0 = s.scalar(select(func.count()).select_from(AdapterVersion))
    first = upload(runtime, tenant, "seeded", tiny_adapters["strong"], eval_set=tiny_adapters["wins"])
    staging = runtime.sandbox_root.parent / "again"
    staging.mkdir()
    with runtime.session_factory() as s:
        base = ensure_base_model(s, name=runtime.base_model_name, model_dir=runtime.base_model_dir)
        again = upload_adapter(s, store=runtime.store, config=runtime.config, sandbox_root=runtime.sandbox_root, base=base,
                               tenant_id=tenant.id, name="seeded", upload=pack_dir(tiny_adapters["strong"], staging / "a.tar"),
                               actor=ACTOR, eval_set=tiny_adapters["wins"], reuse_identical=True)
        s.commit()
    assert (again.version_id, again.created) == (first.version_id, False)
    with runtime.session_factory() as s:
        assert s.scalar(select(func.count()).select_from(AdapterVersion)) == n0 + 1


def test_without_an_eval_set_the_base_capability_set_is_used_unless_it_is_a_demo_kit_adapter(runtime, demo_kit, mplex_home,
                                                                                           tmp_path):
    """No eval set: the platform's base-capability set with the no-regression check — except one of the demo
    kit's own adapters (recognised by content, never by name) while the platform serves the demo kit, which
    is judged on its task's set with the margin check. Serving another model, the demo kit is never looked
    up (let alone built). A configured base set replaces the bundled one; one too small to judge is refused."""
    from dataclasses import replace

    from services.adapters.config import GateDefaults
    from services.adapters.evalset import DEFAULT_EVAL_SET, read_eval_file
    from services.adapters.gate import GateError

    upper = demo_kit.adapters["uppercase"]
    demo_rt = replace(runtime, base_model_dir=Path(demo_kit.base_dir), demo_kit_home=mplex_home)
    plan = load_eval_items(demo_rt, eval_uri=None, content_sha=content_id(Path(upper.path)))
    assert (plan.source, plan.check) == ("demo:uppercase", "margin") and len(plan.items) == runtime.config.gate.max_examples
    assert set(plan.items) <= set(read_eval_file(Path(upper.eval_path)))
    bundled = read_eval_file(DEFAULT_EVAL_SET)
    for rt in (demo_rt, replace(runtime, demo_kit_home=mplex_home)):  # a name is not an identity; the tiny base is not the kit's
        plan = load_eval_items(rt, eval_uri=None, content_sha="0" * 64)
        assert (plan.source, plan.check, plan.min_items) == ("default", "no_regression", 100)
        assert sorted(plan.items, key=repr) == sorted(bundled, key=repr) and len(bundled) == 200
    tiny_rt = replace(runtime, demo_kit_home=mplex_home)
    plan = load_eval_items(tiny_rt, eval_uri=None, content_sha=content_id(Path(upper.path)))
    assert plan.source == "default"
    own = tmp_path / "base.jsonl"
    own.write_bytes(eval_jsonl([f"q{i}" for i in range(120)], [f"a{i}" for i in range(120)]))
    configured = replace(runtime, config=replace(runtime.config, gate=GateDefaults(base_eval_set=str(own))))
    plan = load_eval_items(configured, eval_uri=None, content_sha="1" * 64)
    assert plan.check == "no_regression" and {i.prompt for i in plan.items} == {f"q{i}" for i in range(120)}
    own.write_bytes(eval_jsonl(["q"] * 20, ["a"] * 20))
    with pytest.raises(GateError, match="needs at least 100"):
        load_eval_items(configured, eval_uri=None, content_sha="1" * 64)


def test_without_an_eval_set_the_demo_adapters_and_a_harmless_one_go_ready(runtime, db, demo_kit, mplex_home, tmp_path):
    """Serving the demo kit, with the platform's default thresholds: the kit's adapters (recognised by content)
    pass on their tasks' sets, a harmless random adapter passes the no-regression check on the base-capability
    set, and one that damages the base is refused by it — every check recorded, passed or not."""
    from dataclasses import replace

    import torch

    from services.modelkit import make_random_adapter

    rt = replace(runtime, base_model_dir=Path(demo_kit.base_dir), base_model_name=demo_kit.model_name,
                 demo_kit_home=mplex_home, config=PipelineConfig(gate=GateDefaults(latency_samples=1)))
    rt.enqueue.runtime = rt
    tenant = make_tenant(db)
    modules = ("q_proj", "v_proj", "down_proj")
    harmless = make_random_adapter(demo_kit.base_dir, tmp_path / "harmless", rank=8, seed=5, init_scale=0.02,
                                   target_modules=modules)
    damaging = make_random_adapter(demo_kit.base_dir, tmp_path / "damaging", rank=8, seed=5, init_scale=3.0,
                                   target_modules=modules)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        uploads = {name: upload(rt, tenant, name, Path(d.path)) for name, d in demo_kit.adapters.items()}
        uploads["harmless"] = upload(rt, tenant, "harmless", harmless)
        uploads["damaging"] = upload(rt, tenant, "damaging", damaging)
        for r in uploads.values():
            rt.enqueue.ingest(r.version_id)
    finally:
        torch.set_num_threads(threads)
    for name, r in uploads.items():
        v = version(rt, r.version_id)
        (run,) = runs(rt, r.version_id)
        checks = {x["check"]: x["passed"] for x in run.reasons}
        assert [x["code"] for x in v.eval_summary["reasons"]] == [x["code"] for x in run.reasons]
        if name == "damaging":
            assert v.status == AdapterStatus.REJECTED and run.metrics["check"] == "no_regression"
            assert [x["code"] for x in v.status_reasons][0] == "regression_over_tolerance"
            assert checks["no_regression"] is False and set(checks) == {"no_regression", "well_formed", "logits", "fp8_agreement"}
            continue
        assert v.status == AdapterStatus.READY, (name, v.status_reasons)
        assert all(checks.values()) and len(checks) == 4
        if name == "harmless":
            assert run.metrics["eval_set"] == "default" and run.metrics["n_examples"] == 200 and "no_regression" in checks
        else:
            assert run.metrics["eval_set"] == f"demo:{name}" and "margin" in checks
