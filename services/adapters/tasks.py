"""The adapter pipeline's Celery tasks: thin wrappers over services.adapters.pipeline (idempotent; safe to
run twice). Queues follow the names: `adapters.ingest.*` validate, `adapters.eval.*` run the quality gate.
The shared app (services.common.celery_app) gives them acks_late, reject-on-worker-lost and bounded
retries with backoff on transient infrastructure errors; a message whose worker process keeps dying is
bounded here (`max_deliveries`), so one poisonous upload cannot occupy the workers forever."""
from __future__ import annotations

import logging
import uuid
from functools import lru_cache

from services.adapters.pipeline import (
    Runtime,
    StepOutcome,
    abandon,
    build_runtime,
    count_delivery,
    evaluate_version,
    ingest_version,
    sweep_stalled,
    sync_retired,
)
from services.adapters.retention import collect
from services.common.celery_app import app

log = logging.getLogger("mplex.adapters.tasks")

INGEST = "adapters.ingest.validate"
EVALUATE = "adapters.eval.gate"
SYNC_RETIRED = "adapters.ingest.sync_retired"
SWEEP = "adapters.ingest.sweep"
COLLECT_STORAGE = "adapters.ingest.collect_storage"
# Run by beat (services.common.celery_app.beat_schedule): {task name: every so many seconds}.
PERIODIC = {
    SYNC_RETIRED: 10.0,  # deleted adapters' content ids -> the Redis set engines unload from (+ one heartbeat)
    SWEEP: 60.0,  # versions whose task was lost
    COLLECT_STORAGE: 3600.0,  # retention is counted in days; an hour's delay costs nothing
}


class CeleryEnqueue:
    """The pipeline's next steps as Celery messages (routed to their queue by task name)."""

    def ingest(self, version_id: uuid.UUID) -> None:
        ingest.apply_async(args=[str(version_id)])

    def evaluate(self, version_id: uuid.UUID, attempt: int, countdown: float = 0) -> None:
        evaluate.apply_async(args=[str(version_id), attempt], countdown=countdown or None)


def enqueue_ingest(version_id: uuid.UUID) -> bool:
    """Start the pipeline for a new version (after its upload committed). False if the broker is down: the
    version stays `uploaded` and the periodic sweep enqueues it later."""
    try:
        CeleryEnqueue().ingest(version_id)
        return True
    except Exception as exc:  # kombu/redis connection errors of every flavour: the sweep is the fallback
        log.warning("could not enqueue ingest of %s (the sweep will retry): %s", version_id, exc)
        return False


@lru_cache(maxsize=1)
def runtime() -> Runtime:
    """Built on first use in each worker process (after the prefork pool forks)."""
    import redis

    from services.common.embedded import resolve_urls
    from services.common.settings import get_settings

    settings = get_settings()
    redis_url = settings.redis_url or resolve_urls(settings).redis_url
    return build_runtime(settings, enqueue=CeleryEnqueue(), redis_client=redis.Redis.from_url(redis_url))


def _delivery_id(task) -> str:
    """The same for every redelivery of one message; a retry (a new message, same task id) starts afresh."""
    return f"{task.request.id}:{task.request.retries or 0}"


def _result(version_id: str, out: StepOutcome) -> dict:
    return {"version_id": version_id, "status": out.status, "action": out.action}


@app.task(name=INGEST, bind=True)
def ingest(self, version_id: str) -> dict:
    rt, vid = runtime(), uuid.UUID(version_id)
    deliveries = count_delivery(rt, _delivery_id(self))
    if deliveries > rt.config.max_deliveries:
        return _result(version_id, abandon(rt, vid, deliveries))
    return _result(version_id, ingest_version(rt, vid))


@app.task(name=EVALUATE, bind=True)
def evaluate(self, version_id: str, attempt: int = 1) -> dict:
    rt, vid = runtime(), uuid.UUID(version_id)
    deliveries = count_delivery(rt, _delivery_id(self))
    if deliveries > rt.config.max_deliveries:
        return _result(version_id, abandon(rt, vid, deliveries))
    return _result(version_id, evaluate_version(rt, vid, attempt, task_id=self.request.id))


@app.task(name=SYNC_RETIRED)
def sync_retired_adapters() -> int:
    """Deleted adapters' content ids -> the Redis set engines unload from (run by beat)."""
    rt = runtime()
    with rt.session_factory() as s:
        return len(sync_retired(s, rt.redis, window_s=rt.config.retired_window_s).content_ids)


@app.task(name=SWEEP)
def sweep() -> int:
    """Re-enqueue versions whose task was lost (run by beat)."""
    return len(sweep_stalled(runtime()))


@app.task(name=COLLECT_STORAGE)
def collect_storage() -> dict:
    """Retention, garbage collection and stale temporary files of the object store (run by beat)."""
    rt = runtime()
    return collect(rt.session_factory, rt.store, rt.config, sandbox_root=rt.sandbox_root).as_dict()
