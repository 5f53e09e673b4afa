"""The adapter lifecycle as plain functions (Celery tasks in services.adapters.tasks are thin wrappers):

    uploaded -> validating -> evaluating -> ready | rejected

Every step is idempotent, so a redelivered or duplicated task is harmless: status moves are
compare-and-set on the current status, the gate's run for an attempt is one `eval_runs` row reused by a
redelivery, and a verdict is written (run + version + active pointer) in one transaction that first
re-checks the version is still `evaluating`. Slow work (fetching, validating, generating) happens outside
any transaction; only short writes hold locks.
"""
from __future__ import annotations

import logging
import random
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from services.adapters.base_model import BaseModel, ensure_base_model, load_base_model
from services.adapters.config import PipelineConfig
from services.adapters.checks import MARGIN, NO_REGRESSION
from services.adapters.evalset import DEFAULT_EVAL_SET, EvalItem, parse_eval_set, read_eval_file, sample
from services.adapters.gate import GateError, GateResult, GateRunner, Thresholds
from services.adapters.storage import ObjectStore
from services.adapters.upload import private_dir
from services.adapters.validate import ValidatedAdapter, reason, validate_dir, validate_upload
from services.common.engine_registry import RETIRED_ADAPTERS
from services.common.lora_format import AdapterFormatError, content_id
from services.common.models import (
    Adapter,
    AdapterStatus,
    AdapterVersion,
    BaseModelRecord,
    EvalRun,
    EvalRunStatus,
    GateDecision,
)

log = logging.getLogger("mplex.adapters.pipeline")

RETIRED_KEY = RETIRED_ADAPTERS  # the Redis set of content ids engines must unload (services.common.engine_registry)
UPLOADED, VALIDATING, EVALUATING, READY, REJECTED = (AdapterStatus.UPLOADED, AdapterStatus.VALIDATING,
                                                    AdapterStatus.EVALUATING, AdapterStatus.READY, AdapterStatus.REJECTED)


class Enqueue(Protocol):
    """How the pipeline schedules its next step (Celery in production; tests may chain calls directly)."""

    def ingest(self, version_id: uuid.UUID) -> None: ...

    def evaluate(self, version_id: uuid.UUID, attempt: int, countdown: float = 0) -> None: ...


@dataclass
class Runtime:
    """Everything a pipeline step needs, built once per worker process."""

    session_factory: sessionmaker[Session]
    store: ObjectStore
    config: PipelineConfig
    sandbox_root: Path  # private per-operation directories are made (and removed) under here
    base_model_dir: Path
    base_model_name: str
    enqueue: Enqueue
    redis: Any = None  # redis.Redis, for the retired-adapters set
    demo_kit_home: Path | None = None  # where the demo kit lives; when it is the served base, its task eval sets are defaults
    _gate: GateRunner | None = None

    def gate(self) -> GateRunner:
        if self._gate is None:
            self._gate = GateRunner(self.base_model_dir, serve_weight_dtype=self.config.serve_weight_dtype,
                                    compute_dtype=self.config.compute_dtype, max_lora_rank=self.config.max_lora_rank)
        return self._gate

    def base_model(self, session: Session, base_model_id: uuid.UUID | None = None) -> BaseModel:
        if base_model_id is not None:
            row = session.get(BaseModelRecord, base_model_id)
        else:
            row = ensure_base_model(session, name=self.base_model_name, model_dir=self.base_model_dir,
                                    max_lora_rank=self.config.max_lora_rank)
        model_dir = self.base_model_dir if row.name == self.base_model_name else None
        return load_base_model(row, model_dir=model_dir, max_lora_rank=self.config.max_lora_rank,
                               extra_names=self.config.accepted_base_names)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    version_id: uuid.UUID
    status: str  # the version's status after the step
    action: str  # what this call did: "validated", "rejected", "decided", "retry", "noop", ...


def _now() -> datetime:
    return datetime.now(timezone.utc)


def move(session: Session, version_id: uuid.UUID, from_: tuple[AdapterStatus, ...], to: AdapterStatus, **values) -> bool:
    """Compare-and-set the status: True if this call made the move."""
    result = session.execute(update(AdapterVersion).where(AdapterVersion.id == version_id, AdapterVersion.status.in_(from_))
                             .values(status=to, **values))
    return result.rowcount == 1


def set_progress(rt: Runtime, version_id: uuid.UUID, status: AdapterStatus, percent: int, step: str) -> None:
    """Progress for the UI's bar, written only while the version is still in `status` (never over a verdict)."""
    with rt.session_factory() as s:
        s.execute(update(AdapterVersion).where(AdapterVersion.id == version_id, AdapterVersion.status == status)
                  .values(progress_percent=max(0, min(100, int(percent))), progress_step=step[:200]))
        s.commit()


# -- ingest: validation -------------------------------------------------------------------------------------------
def ingest_version(rt: Runtime, version_id: uuid.UUID) -> StepOutcome:
    with rt.session_factory() as s:
        v = s.get(AdapterVersion, version_id)
        if v is None:
            log.warning("ingest: version %s does not exist", version_id)
            return StepOutcome(version_id, "missing", "noop")
        if v.status.is_final:
            return StepOutcome(version_id, str(v.status), "noop")
        if v.status == EVALUATING:
            # Validated before, but the worker may have died before the gate was enqueued: enqueue it again
            # (a second gate task for the same attempt is a no-op once the first has decided).
            rt.enqueue.evaluate(version_id, attempt=_current_attempt(s, version_id))
            return StepOutcome(version_id, str(v.status), "requeued_eval")
        move(s, version_id, (UPLOADED, VALIDATING), VALIDATING, progress_percent=5, progress_step="validating: fetching files")
        s.commit()
        uri, sha, base = v.storage_uri, v.content_sha256, rt.base_model(s, v.base_model_id)

    try:
        validated = _validate_stored(rt, version_id, uri, sha, base)
    except AdapterFormatError as exc:
        return _reject(rt, version_id, (VALIDATING,), [reason(exc)])
    except Exception as exc:  # a file that breaks a parser in an unforeseen way is still a refusal, not a crash
        if _is_transient(exc):
            raise
        log.exception("validating version %s failed unexpectedly", version_id)
        return _reject(rt, version_id, (VALIDATING,), [{"code": "validation_failed",
                                                         "message": f"the adapter could not be validated: {type(exc).__name__}"}])
    with rt.session_factory() as s:
        shape = validated.shape
        moved = move(s, version_id, (VALIDATING,), EVALUATING, rank=shape.rank, alpha=shape.alpha,
                     target_modules=list(shape.target_modules), status_reasons=[], progress_percent=40,
                     progress_step="queued for the quality gate")
        s.commit()
    if not moved:
        return StepOutcome(version_id, "unknown", "noop")
    rt.enqueue.evaluate(version_id, attempt=1)
    return StepOutcome(version_id, str(EVALUATING), "validated")


def _validate_stored(rt: Runtime, version_id: uuid.UUID, uri: str, sha: str, base: BaseModel) -> ValidatedAdapter:
    key = rt.store.key_of(uri)
    with private_dir(rt.sandbox_root, "ingest-") as sandbox:
        if key.startswith("uploads/"):
            # An upload that could not be identified at upload time: unpack it here to say why.
            raw = rt.store.fetch(uri, sandbox / "upload")
            set_progress(rt, version_id, VALIDATING, 15, "validating: unpacking the archive")
            unpacked = sandbox / "unpacked"
            unpacked.mkdir(mode=0o700)
            validated = validate_upload(raw, unpacked, base=base, limits=rt.config.archive)
            raise AdapterFormatError("content_mismatch", f"the upload could not be identified when it was received "
                                                         f"(its files hash to {validated.content_id[:12]}…); upload it again")
        files = rt.store.fetch(uri, sandbox / "adapter")
        set_progress(rt, version_id, VALIDATING, 20, "validating: config, tensors, shapes")
        return validate_dir(files, base=base, expected_content_id=sha)


# -- evaluate: the quality gate ---------------------------------------------------------------------------------
def evaluate_version(rt: Runtime, version_id: uuid.UUID, attempt: int = 1, *, task_id: str | None = None) -> StepOutcome:
    with rt.session_factory() as s:
        v = s.get(AdapterVersion, version_id)
        if v is None:
            return StepOutcome(version_id, "missing", "noop")
        if v.status != EVALUATING:
            return StepOutcome(version_id, str(v.status), "noop")
        s.execute(insert(EvalRun).values(id=uuid.uuid4(), adapter_version_id=version_id, attempt=attempt,
                                         status=EvalRunStatus.RUNNING, task_id=task_id)
                  .on_conflict_do_nothing(index_elements=[EvalRun.adapter_version_id, EvalRun.attempt]))
        run = s.scalar(select(EvalRun).where(EvalRun.adapter_version_id == version_id, EvalRun.attempt == attempt)
                       .with_for_update())
        if run.status != EvalRunStatus.RUNNING:
            return StepOutcome(version_id, str(v.status), "noop")  # this attempt already ended
        run.task_id, run.started_at = task_id, _now()  # a redelivery restarts the same attempt
        s.commit()
        run_id = run.id
        uri, sha, gate_config, eval_uri = v.storage_uri, v.content_sha256, v.gate_config, v.eval_set_uri

    set_progress(rt, version_id, EVALUATING, 45, "evaluating: loading the eval set")
    try:
        plan = load_eval_items(rt, eval_uri=eval_uri, content_sha=sha)
        thresholds = Thresholds.from_config(gate_config, rt.config.gate)

        last = [45]

        def progress(fraction: float, step: str) -> None:
            percent = 45 + int(50 * fraction)
            if percent > last[0]:
                last[0] = percent
                set_progress(rt, version_id, EVALUATING, percent, step)

        result = rt.gate().run(uri, sha, plan.items, thresholds, check=plan.check, min_items=plan.min_items,
                               max_new_tokens=rt.config.gate.max_new_tokens,
                               latency_samples=rt.config.gate.latency_samples, progress=progress)
        result.metrics["eval_set"] = plan.source
    except AdapterFormatError as exc:  # the engine refused to load it: a verdict, not a failure of the run
        return _finish(rt, version_id, run_id, attempt, None, refusal=reason(exc))
    except Exception as exc:
        if _is_transient(exc):
            raise
        log.exception("quality gate for version %s (attempt %d) failed", version_id, attempt)
        return _fail_run(rt, version_id, run_id, attempt, exc)
    try:
        return _finish(rt, version_id, run_id, attempt, result)
    except Exception as exc:  # the verdict could not be stored: the run failed, a new attempt decides again
        if _is_transient(exc):
            raise
        log.exception("recording the gate's verdict for version %s (attempt %d) failed", version_id, attempt)
        return _fail_run(rt, version_id, run_id, attempt, exc)


@dataclass(frozen=True, slots=True)
class EvalPlan:
    """What the gate runs on and how it judges: a task eval set with the margin check, or the base-capability
    set with the no-regression check."""

    items: list[EvalItem]
    source: str  # "tenant" | "demo:<task>" | "default" (the base-capability set, bundled or configured)
    check: str  # MARGIN | NO_REGRESSION
    min_items: int = 1


def load_eval_items(rt: Runtime, *, eval_uri: str | None, content_sha: str) -> EvalPlan:
    """The tenant's eval set (margin); else, for one of the demo kit's own adapters (by content id) when the
    platform serves the demo kit, that adapter's task set (margin); else the base-capability set
    (no-regression): `base_eval_set` if configured, else the bundled one. Sampled deterministically (seeded
    by the content id)."""
    gate = rt.config.gate
    if eval_uri:
        data = rt.store.read_bytes(eval_uri, max_bytes=rt.config.max_eval_set_bytes)
        items = parse_eval_set(data, max_items=rt.config.max_eval_items)
        return EvalPlan(sample(items, gate.max_examples, seed=content_sha), "tenant", MARGIN)
    demo = _demo_eval_path(rt, content_sha)
    if demo is not None:
        return EvalPlan(sample(read_eval_file(demo[1]), gate.max_examples, seed=content_sha), f"demo:{demo[0]}", MARGIN)
    path = Path(gate.base_eval_set) if gate.base_eval_set else DEFAULT_EVAL_SET
    items = read_eval_file(path)
    if len(items) < gate.min_base_examples:
        raise GateError(f"the base-capability set {path} has {len(items)} items; the no-regression check needs at "
                        f"least {gate.min_base_examples}")
    return EvalPlan(sample(items, gate.base_max_examples, seed=content_sha), "default", NO_REGRESSION,
                    min_items=gate.min_base_examples)


def _demo_eval_path(rt: Runtime, content_sha: str) -> tuple[str, Path] | None:
    """One of the demo kit's adapters, recognised by content id (never by name: a tenant's adapter called
    "sort" is not the sort adapter), and only when the platform serves the demo kit's base model (built
    already: it is what is served)."""
    if rt.demo_kit_home is None:
        return None
    demo_root = (Path(rt.demo_kit_home) / "models" / "demo").resolve()
    if demo_root not in Path(rt.base_model_dir).resolve().parents:
        return None  # another model: never build the demo kit just to look for eval sets
    from services.modelkit import ensure_demo

    kit = ensure_demo(rt.demo_kit_home, progress=False)  # already built: it is the base model being served
    if Path(kit.base_dir).resolve() != Path(rt.base_model_dir).resolve():
        return None
    by_content = {}
    for demo in kit.adapters.values():
        try:
            by_content[content_id(Path(demo.path))] = demo
        except AdapterFormatError:
            continue
    demo = by_content.get(content_sha)
    return (demo.task, Path(demo.eval_path)) if demo is not None else None


def json_safe(value: Any) -> Any:
    """`value` with every string storable in Postgres JSONB/text, which refuse U+0000 (a model's output,
    an eval set's expected text or a refusal message may hold one): NUL becomes U+FFFD."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _finish(rt: Runtime, version_id: uuid.UUID, run_id: uuid.UUID, attempt: int, result: GateResult | None, *,
            refusal: dict[str, str] | None = None) -> StepOutcome:
    """Record the verdict: the run, the version's status and summary, and the active pointer — one transaction."""
    now = _now()
    with rt.session_factory() as s:
        v = s.get(AdapterVersion, version_id, with_for_update=True, populate_existing=True)
        if v.status != EVALUATING:
            return StepOutcome(version_id, str(v.status), "noop")  # a duplicate run decided first
        run = s.get(EvalRun, run_id, with_for_update=True, populate_existing=True)
        sha = v.content_sha256
        if result is None:
            passed, failures = False, [refusal]
            refusal = json_safe(refusal)
            run.reasons = [{**refusal, "passed": False}]
            summary = {"passed": False, "attempt": attempt, "eval_run_id": str(run_id), "refused": refusal,
                       "metrics": {}, "thresholds": v.gate_config or {}, "examples": []}
        else:
            passed, failures = result.passed, json_safe(result.failures)
            run.metrics, run.examples, run.reasons = json_safe(result.metrics), json_safe(result.examples), json_safe(result.reasons)
            summary = {"passed": result.passed, "attempt": attempt, "eval_run_id": str(run_id), "metrics": result.metrics,
                       "thresholds": result.thresholds, "reasons": result.reasons, "examples": result.examples[:20]}
        run.status, run.decision, run.finished_at = EvalRunStatus.FINISHED, GateDecision.PASS if passed else GateDecision.FAIL, now
        v.eval_summary = json_safe(summary)
        v.progress_percent, v.progress_step = 100, "ready" if passed else "rejected by the quality gate"
        if passed:
            v.status, v.ready_at, v.status_reasons = READY, now, []
            s.flush()
            promote(s, v.adapter_id)
        else:
            v.status, v.status_reasons = REJECTED, failures
        s.commit()
    if passed:
        unretire(rt, [sha])
    return StepOutcome(version_id, str(READY if passed else REJECTED), "decided")


def _fail_run(rt: Runtime, version_id: uuid.UUID, run_id: uuid.UUID, attempt: int, exc: Exception) -> StepOutcome:
    """The gate itself broke: the run is marked failed, and a new attempt is scheduled (with backoff) until
    the attempts are spent, then the version is rejected saying so (a platform admin may override)."""
    message = f"the quality gate could not run: {type(exc).__name__}: {str(exc)[:300]}"
    with rt.session_factory() as s:
        run = s.get(EvalRun, run_id, with_for_update=True)
        if run.status == EvalRunStatus.RUNNING:
            run.status, run.finished_at = EvalRunStatus.FAILED, _now()
            run.reasons = json_safe([{"code": "eval_error", "message": message, "passed": False}])
        s.commit()
    if attempt < rt.config.max_eval_attempts:
        set_progress(rt, version_id, EVALUATING, 45, f"evaluating: retrying (attempt {attempt + 1})")
        rt.enqueue.evaluate(version_id, attempt=attempt + 1, countdown=min(300, 5 * 2 ** attempt * (1 + random.random())))
        return StepOutcome(version_id, str(EVALUATING), "retry")
    return _reject(rt, version_id, (EVALUATING,), [{"code": "eval_failed", "message": message}])


def _reject(rt: Runtime, version_id: uuid.UUID, from_: tuple[AdapterStatus, ...], reasons: list[dict[str, str]]) -> StepOutcome:
    with rt.session_factory() as s:
        moved = move(s, version_id, from_, REJECTED, status_reasons=json_safe(reasons), progress_percent=100,
                     progress_step="rejected")
        s.commit()
    return StepOutcome(version_id, str(REJECTED), "rejected" if moved else "noop")


def _current_attempt(session: Session, version_id: uuid.UUID) -> int:
    attempts = list(session.scalars(select(EvalRun.attempt).where(EvalRun.adapter_version_id == version_id,
                                                                  EvalRun.status != EvalRunStatus.FAILED)))
    failed = list(session.scalars(select(EvalRun.attempt).where(EvalRun.adapter_version_id == version_id,
                                                                EvalRun.status == EvalRunStatus.FAILED)))
    return max(attempts, default=max(failed, default=0) + 1)


def _is_transient(exc: BaseException) -> bool:
    from services.common.celery_app import _transient_errors

    return isinstance(exc, _transient_errors())


# -- poison pills ----------------------------------------------------------------------------------------------
DELIVERIES_KEY = "mplex:adapters:deliveries:{}"  # per message: a redelivered message keeps its task id


def count_delivery(rt: Runtime, delivery_id: str | None) -> int:
    """How many times this task message has started (acks_late redelivers it when its worker process dies)."""
    if rt.redis is None or not delivery_id:
        return 1
    key = DELIVERIES_KEY.format(delivery_id)
    with rt.redis.pipeline(transaction=True) as pipe:
        pipe.incr(key)
        pipe.expire(key, 7 * 86_400)
        n, _ = pipe.execute()
    return int(n)


def abandon(rt: Runtime, version_id: uuid.UUID, deliveries: int) -> StepOutcome:
    """A version whose task killed its worker process `deliveries` times (out of memory, a crash in native
    code) is refused instead of being redelivered forever; a platform admin may override it."""
    message = (f"processing this adapter stopped the worker {deliveries - 1} times (out of memory or a crash); "
               f"it is refused to protect the other uploads")
    with rt.session_factory() as s:
        for run in s.scalars(select(EvalRun).where(EvalRun.adapter_version_id == version_id,
                                                   EvalRun.status == EvalRunStatus.RUNNING).with_for_update()):
            run.status, run.finished_at = EvalRunStatus.FAILED, _now()
            run.reasons = [{"code": "worker_lost", "message": message, "passed": False}]
        s.commit()
    log.error("version %s: %s", version_id, message)
    return _reject(rt, version_id, (UPLOADED, VALIDATING, EVALUATING), [{"code": "worker_lost", "message": message}])


# -- promotion and retirement -------------------------------------------------------------------------------------
def promote(session: Session, adapter_id: uuid.UUID) -> uuid.UUID | None:
    """Point a live adapter at its newest ready version (called as a version becomes ready)."""
    adapter = session.get(Adapter, adapter_id, with_for_update=True, populate_existing=True)
    if adapter is None or adapter.deleted_at is not None:
        return None
    newest = session.scalar(select(AdapterVersion.id).where(AdapterVersion.adapter_id == adapter_id,
                                                            AdapterVersion.status == READY)
                            .order_by(AdapterVersion.version.desc()).limit(1))
    if newest is not None:
        adapter.active_version_id = newest
        session.flush()
    return newest


def unretire(rt: Runtime, content_ids: list[str | None]) -> None:
    """A content id that is routable again must not be unloaded by engines."""
    ids = [c for c in content_ids if c]
    if rt.redis is None or not ids:
        return
    try:
        rt.redis.srem(RETIRED_KEY, *ids)
    except Exception as exc:  # the next sync_retired rebuilds the set from Postgres anyway
        log.warning("could not update %s: %s", RETIRED_KEY, exc)


@dataclass(frozen=True, slots=True)
class RetiredSet:
    content_ids: frozenset[str]


def retired_content_ids(session: Session, *, window: timedelta) -> frozenset[str]:
    """Content ids engines may hold but nothing routes to any more: versions that were ready, of adapters
    deleted within `window` or demoted (overridden to rejected) within it — minus any content id some
    live adapter still routes to (another tenant may have uploaded the same files)."""
    since = _now() - window
    routable = set(session.scalars(
        select(AdapterVersion.content_sha256).join(Adapter, Adapter.id == AdapterVersion.adapter_id)
        .where(Adapter.deleted_at.is_(None), AdapterVersion.status == READY)
    ))
    gone = set(session.scalars(
        select(AdapterVersion.content_sha256).join(Adapter, Adapter.id == AdapterVersion.adapter_id)
        .where(AdapterVersion.ready_at.is_not(None),
               ((Adapter.deleted_at.is_not(None)) & (Adapter.deleted_at >= since))
               | ((AdapterVersion.status != READY) & (AdapterVersion.updated_at >= since)))
    ))
    return frozenset(gone - routable)


def sync_retired(session: Session, redis, *, window_s: float) -> RetiredSet:
    """Rebuild the Redis set engines read on every heartbeat (services.engine.registry.RETIRED_ADAPTERS)
    from Postgres, atomically, with a TTL refreshed on every sync."""
    ids = retired_content_ids(session, window=timedelta(seconds=window_s))
    with redis.pipeline(transaction=True) as pipe:
        pipe.delete(RETIRED_KEY)
        if ids:
            pipe.sadd(RETIRED_KEY, *sorted(ids))
            pipe.expire(RETIRED_KEY, int(window_s))
        pipe.execute()
    return RetiredSet(ids)


# -- the sweeper ----------------------------------------------------------------------------------------------
def sweep_stalled(rt: Runtime, *, older_than_s: float | None = None) -> list[tuple[uuid.UUID, str]]:
    """Re-enqueue versions whose task was lost (the broker was down at upload, a worker vanished before it
    could requeue): anything not final and not updated for `stalled_after_s`. Steps are idempotent, so a
    version that was merely slow loses nothing."""
    cutoff = _now() - timedelta(seconds=older_than_s if older_than_s is not None else rt.config.stalled_after_s)
    out = []
    with rt.session_factory() as s:
        rows = s.execute(select(AdapterVersion.id, AdapterVersion.status)
                         .where(AdapterVersion.status.in_((UPLOADED, VALIDATING, EVALUATING)),
                                AdapterVersion.updated_at < cutoff).limit(500)).all()
        for vid, status in rows:
            if status == EVALUATING:
                rt.enqueue.evaluate(vid, attempt=_current_attempt(s, vid))
                out.append((vid, "evaluate"))
            else:
                rt.enqueue.ingest(vid)
                out.append((vid, "ingest"))
    return out


class InlineEnqueue:
    """Runs each next step at once in this process (the CLI's `--inline`, tests of the plain functions)."""

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.calls: list[tuple[str, uuid.UUID, int | None]] = []

    def ingest(self, version_id: uuid.UUID) -> None:
        self.calls.append(("ingest", version_id, None))
        assert self.runtime is not None
        ingest_version(self.runtime, version_id)

    def evaluate(self, version_id: uuid.UUID, attempt: int, countdown: float = 0) -> None:
        self.calls.append(("evaluate", version_id, attempt))
        assert self.runtime is not None
        evaluate_version(self.runtime, version_id, attempt)


def build_runtime(settings, *, enqueue: Enqueue, config: PipelineConfig | None = None, redis_client=None,
                  session_factory: sessionmaker[Session] | None = None) -> Runtime:
    from services.adapters.base_model import base_model_dir
    from services.common.db import get_db_engine, make_sessionmaker

    return Runtime(
        session_factory=session_factory or make_sessionmaker(get_db_engine()),
        store=ObjectStore.from_settings(settings),
        config=config or PipelineConfig.from_env(),
        sandbox_root=settings.home / "sandbox",
        base_model_dir=base_model_dir(settings),
        base_model_name=settings.base_model_name,
        enqueue=enqueue,
        redis=redis_client,
        demo_kit_home=settings.home,
    )

