"""`make up` seeds the demo kit's adapters for the demo tenant through the real pipeline (upload ->
validation -> quality gate -> ready), each with its task's eval set. Idempotent: an adapter whose
content was already uploaded under its name keeps that version (no duplicates); a version not yet decided
(its task lost when the previous `make up` stopped) is enqueued again (every step is idempotent)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.common.models import AdapterStatus


@dataclass(frozen=True, slots=True)
class SeededAdapter:
    name: str
    version_id: uuid.UUID
    version: int
    status: str
    created: bool  # False: this content was already uploaded


def seed_demo_adapters(*, tenant: str = "demo", kit=None, settings=None, session_factory=None,
                       enqueue=None) -> list[SeededAdapter]:
    """Upload every demo adapter (`services.modelkit.ensure_demo().adapters`) for `tenant` (slug or id).
    `enqueue(version_id)` starts the pipeline (default: a Celery message to the ingest queue); a worker
    must be running for the versions to move on. Returns one entry per adapter, by name."""
    from services.adapters.upload import upload_from_path
    from services.adapters.upload import private_dir
    from services.common.settings import get_settings

    settings = settings or get_settings()
    if kit is None:
        from services.modelkit import ensure_demo

        kit = ensure_demo(settings.home, progress=False)
    if enqueue is None:
        from services.adapters.tasks import enqueue_ingest as enqueue
    out = []
    with private_dir(settings.home / "sandbox", "seed-") as staging:
        for name, demo in sorted(kit.adapters.items()):
            eval_path = getattr(demo, "eval_path", None)
            result = upload_from_path(Path(demo.path), tenant=tenant, name=name, staging=staging,
                                 eval_set=Path(eval_path).read_bytes() if eval_path else None, reuse_identical=True,
                                 settings=settings, session_factory=session_factory)
            if result.created or not AdapterStatus(result.status).is_final:
                enqueue(result.version_id)  # ingest is idempotent; for an `evaluating` version it re-enqueues the gate
            out.append(SeededAdapter(name, result.version_id, result.version, result.status, result.created))
    return out


def wait_until_decided(version_ids: list[uuid.UUID], *, timeout_s: float = 1800, session_factory=None) -> dict[uuid.UUID, str]:
    """Poll until every version is ready or rejected (or the timeout passes); returns their statuses."""
    from sqlalchemy import select

    from services.common.db import session_scope
    from services.common.models import AdapterVersion

    deadline = time.monotonic() + timeout_s
    while True:
        with session_scope(session_factory) as s:
            statuses = dict(s.execute(select(AdapterVersion.id, AdapterVersion.status)
                                      .where(AdapterVersion.id.in_(version_ids))).tuples().all())
        if all(AdapterStatus(st).is_final for st in statuses.values()) or time.monotonic() > deadline:
            return {vid: str(st) for vid, st in statuses.items()}
        time.sleep(1.0)
