"""The shared Celery app: queues for adapter ingest/eval and billing, safe task defaults, the beat schedule.

Configuration is a lazy promise read from the settings the first time Celery needs it (sending a task,
starting a worker), so importing this module connects nowhere. The broker is `MPLEX_BROKER_URL`, else
the Redis next to the platform's (embedded in dev: `services.common.embedded.resolve_urls`).

Task defaults: acknowledged after they finish (`acks_late`) and requeued if their worker process dies, one
message prefetched per process, JSON only, bounded retries with exponential backoff on transient
infrastructure errors. Tasks must therefore be idempotent — they are thin wrappers over plain functions.
Task names say their queue: `billing.*`, `adapters.ingest.*`, `adapters.eval.*`, `batches.*` (the Batch API).
"""
from __future__ import annotations

import importlib
from typing import Any

from celery import Celery, Task
from kombu import Queue

QUEUES = ("adapters.ingest", "adapters.eval", "billing", "batches")
# Each task module declares its periodic tasks in PERIODIC ({task name: seconds}); the worker imports them
# by name, as Celery's `include` does, so this lower layer imports no service.
TASK_MODULES = ("services.billing.tasks", "services.adapters.tasks", "services.batch.tasks")
# With acks_late on Redis, an unacknowledged message is redelivered after this long if its worker vanished
# without requeueing it (a killed host); longer than the slowest task (an adapter's quality-gate eval).
VISIBILITY_TIMEOUT_S = 3 * 3600


def _transient_errors() -> tuple[type[BaseException], ...]:
    import psycopg
    import redis.exceptions
    import sqlalchemy.exc
    from kombu.exceptions import OperationalError as KombuOperationalError

    return (
        sqlalchemy.exc.OperationalError,  # Postgres restarting, failover, connection dropped
        psycopg.OperationalError,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        KombuOperationalError,
    )


class MplexTask(Task):
    """Base task: transient infrastructure errors retry with exponential backoff (2 s, 4 s, ... capped at
    5 min, jittered), at most 5 times; anything else fails the task at once (a bug, not an outage)."""

    autoretry_for = _transient_errors()
    retry_backoff = 2
    retry_backoff_max = 300
    retry_jitter = True
    max_retries = 5
    acks_late = True
    reject_on_worker_lost = True


def celery_config(settings: Any = None) -> dict[str, Any]:
    from services.common.settings import get_settings

    settings = settings or get_settings()
    broker_url = settings.broker_url
    if broker_url is None:
        from services.common.embedded import resolve_urls

        broker_url = resolve_urls(settings).broker_url
    return {
        "broker_url": broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT_S},
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,  # a task that raised is done (it retried already if it could)
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": True,  # their messages come back; no double runs
        "worker_hijack_root_logger": False,
        "task_queues": [Queue(q, routing_key=q) for q in QUEUES],
        "task_default_queue": "billing",
        "task_routes": {
            "billing.*": {"queue": "billing"},
            "adapters.ingest.*": {"queue": "adapters.ingest"},
            "adapters.eval.*": {"queue": "adapters.eval"},
            "batches.*": {"queue": "batches"},
        },
        "include": list(TASK_MODULES),
        "timezone": "UTC",
        "enable_utc": True,
    }


def beat_schedule() -> dict[str, dict[str, Any]]:
    """Every task module's PERIODIC tasks. Each run is idempotent; `expires` drops runs that queued up while
    no worker was there to take them (the next run does the same work).

    Only `mplex beat` asks for it, once the app is configured: computed inside `celery_config` it imported
    the task modules while one of them was half-imported (a task decorator reads the configuration), the
    lazy configuration failed, and Celery fell back to its defaults -- an AMQP broker and no adapter tasks."""
    schedule = {}
    for module in TASK_MODULES:
        for task, seconds in importlib.import_module(module).PERIODIC.items():
            schedule[task] = {"task": task, "schedule": seconds, "options": {"expires": seconds}}
    return schedule


def create_celery(settings: Any = None) -> Celery:
    """A Celery app configured from `settings` (default: the process's) when first used."""
    celery = Celery("mplex", task_cls=MplexTask)
    celery.add_defaults(lambda: celery_config(settings))
    return celery


app = create_celery()
