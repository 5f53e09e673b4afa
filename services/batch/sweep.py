"""Finds unfinished batches whose runner is gone (its worker died): their runner lock is free.

A batch still `validating` is normally waiting in the queue for a worker; it counts as orphaned only once it
has waited longer than VALIDATING_GRACE (its message was lost, e.g. the broker was down when it was created),
so a backlog of waiting batches is not enqueued again on every sweep."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import or_, select
from sqlalchemy.engine import Engine

from services.batch.checkpoint import try_lock, unlock
from services.common.batch_contract import TERMINAL, BatchStatus, batch_public_id
from services.common.models import Batch

VALIDATING_GRACE = timedelta(minutes=10)


def orphaned_batches(db_engine: Engine) -> list[str]:
    stale = datetime.now(timezone.utc) - VALIDATING_GRACE
    with db_engine.connect() as conn:
        ids = conn.execute(select(Batch.id).where(
            Batch.status.not_in([s.value for s in TERMINAL]),
            or_(Batch.status != BatchStatus.VALIDATING, Batch.created_at < stale))).scalars().all()
        conn.commit()
        out = []
        for batch_id in ids:
            if try_lock(conn, batch_id):  # nobody runs it
                unlock(conn, batch_id)
                out.append(batch_public_id(batch_id))
    return out
