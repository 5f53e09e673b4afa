"""The Batch API's Celery tasks (queue `batches`): thin and idempotent over services.batch.runner.

`batches.run` runs one batch to its end; run twice, the second finds the runner lock taken and returns.
`batches.sweep` (beat, and once when a worker comes up) starts a runner for every unfinished batch that has
none — a batch whose worker was killed resumes from its checkpoint within one sweep."""
from __future__ import annotations

import logging

from celery.signals import worker_ready

from services.common.batch_contract import BATCH_PREFIX, QUEUE, TASK_RUN, TASK_SWEEP, parse_public_id
from services.common.celery_app import app

log = logging.getLogger("mplex.batch.tasks")

SWEEP_INTERVAL_S = 30
PERIODIC = {TASK_SWEEP: SWEEP_INTERVAL_S}


@app.task(name=TASK_RUN)
def run(batch_id: str) -> str:
    from services.batch.runner import run_batch
    from services.common.settings import get_settings

    parsed = parse_public_id(batch_id, BATCH_PREFIX)
    if parsed is None:
        log.error("batches.run: %r is not a batch id", batch_id)
        return "not a batch id"
    return run_batch(parsed, get_settings())


@app.task(name=TASK_SWEEP)
def sweep() -> list[str]:
    """Send `batches.run` for each unfinished batch no runner holds. Returns the batch ids sent."""
    from services.batch.sweep import orphaned_batches
    from services.common.db import get_db_engine

    ids = orphaned_batches(get_db_engine())
    for public_id in ids:
        app.send_task(TASK_RUN, args=[public_id], queue=QUEUE)
    return ids


@worker_ready.connect
def _resume_on_start(sender=None, **_) -> None:
    """A worker that consumes the batches queue resumes orphaned batches as soon as it is up."""
    if QUEUE in _consumed(sender):
        app.send_task(TASK_SWEEP, queue=QUEUE)


def _consumed(sender) -> set[str]:
    try:
        return {q.name for q in sender.task_consumer.queues}
    except AttributeError:
        return set()
