"""The adapter pipeline's Celery tasks: thin wrappers over services.adapters.pipeline (idempotent; safe to
run twice). Queues follow the names: `adapters.ingest.*` validate, `adapters.eval.*` run the quality gate.
The shared app (services.common.celery_app) gives them acks_late, reject-on-worker-lost and bounded
retries with backoff on transient infrastructure errors."""
from __future__ import annotations

import logging
import uuid
from functools import lru_cache

from services.adapters.pipeline import Runtime, build_runtime, evaluate_version, ingest_version, sweep_stalled, sync_retired
from services.common.celery_app import app

log = logging.getLogger("mplex.adapters.tasks")

INGEST = "adapters.ingest.validate"
EVALUATE = "adapters.eval.gate"
SYNC_RETIRED = "adapters.ingest.sync_retired"
SWEEP = "adapters.ingest.sweep"


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


@app.task(name=INGEST)
def ingest(version_id: str) -> dict:
    out = ingest_version(runtime(), uuid.UUID(version_id))
    return {"version_id": version_id, "status": out.status, "action": out.action}


@app.task(name=EVALUATE, bind=True)
def evaluate(self, version_id: str, attempt: int = 1) -> dict:
    out = evaluate_version(runtime(), uuid.UUID(version_id), attempt, task_id=self.request.id)
    return {"version_id": version_id, "status": out.status, "action": out.action}


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
