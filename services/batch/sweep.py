"""Finds unfinished batches whose runner is gone (its worker died): their runner lock is free."""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.engine import Engine

from services.batch.checkpoint import try_lock, unlock
from services.common.batch_contract import TERMINAL, batch_public_id
from services.common.models import Batch


def orphaned_batches(db_engine: Engine) -> list[str]:
    with db_engine.connect() as conn:
        ids = conn.execute(select(Batch.id).where(Batch.status.not_in([s.value for s in TERMINAL]))).scalars().all()
        conn.commit()
        out = []
        for batch_id in ids:
            if try_lock(conn, batch_id):  # nobody runs it
                unlock(conn, batch_id)
                out.append(batch_public_id(batch_id))
    return out
