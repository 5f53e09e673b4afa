"""A batch's progress in Postgres, the one record of what has been answered.

Exactly once: a line leaves `pending` in one transaction together with its ledger row (whose request id is
derived from the batch and line number) and the batch's counters. A runner killed at any point leaves every
line either answered-and-metered or pending; the next runner answers the pending ones. One runner per batch:
a session-level advisory lock, released by Postgres when the runner's connection dies with it.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import orjson
from sqlalchemy import select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, sessionmaker

from services.adapters.storage import ObjectStore
from services.batch import parts
from services.common.batch_contract import TERMINAL, BatchStatus, LineState, output_line
from services.common.models import Batch, BatchLine
from services.gateway.metering import UsageRecord, insert_in

_LOCK_CLASS = 0x6D70_6C78  # "mplx": the advisory-lock class of batch runners


@dataclass(frozen=True, slots=True)
class BatchInfo:
    id: uuid.UUID
    tenant_id: uuid.UUID
    api_key_id: uuid.UUID | None
    status: BatchStatus
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class PendingLine:
    line_no: int
    custom_id: str
    url: str
    body: dict


def _lock_key(batch_id: uuid.UUID) -> int:
    return int.from_bytes(batch_id.bytes[-4:], "big", signed=True)  # uuid7's random tail


def try_lock(conn: Connection, batch_id: uuid.UUID) -> bool:
    """Take the batch's runner lock on `conn` (held until released or the connection closes)."""
    got = conn.execute(text("SELECT pg_try_advisory_lock(:c, :k)"), {"c": _LOCK_CLASS, "k": _lock_key(batch_id)}).scalar_one()
    conn.commit()
    return bool(got)


def unlock(conn: Connection, batch_id: uuid.UUID) -> None:
    conn.execute(text("SELECT pg_advisory_unlock(:c, :k)"), {"c": _LOCK_CLASS, "k": _lock_key(batch_id)})
    conn.commit()


def start(session_factory: sessionmaker[Session], batch_id: uuid.UUID) -> BatchInfo | None:
    """The batch, moved from `validating` to `in_progress` (lines were checked at upload); None if unknown."""
    with session_factory() as s:
        b = s.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())
        if b is None:
            return None
        if b.status == BatchStatus.VALIDATING:
            b.status, b.in_progress_at = BatchStatus.IN_PROGRESS, datetime.now(timezone.utc)
        s.commit()
        return BatchInfo(b.id, b.tenant_id, b.api_key_id, b.status, b.expires_at)


def should_stop(session_factory: sessionmaker[Session], batch_id: uuid.UUID) -> bool:
    """Cancelled, or its completion window is over (read each time: an operator may move either)."""
    with session_factory() as s:
        status, expires_at = s.execute(select(Batch.status, Batch.expires_at).where(Batch.id == batch_id)).one()
    return status != BatchStatus.IN_PROGRESS or expires_at <= datetime.now(timezone.utc)


def pending(session_factory: sessionmaker[Session], batch_id: uuid.UUID, *, after: int, limit: int) -> list[PendingLine]:
    with session_factory() as s:
        rows = s.execute(select(BatchLine.line_no, BatchLine.custom_id, BatchLine.url, BatchLine.body)
                         .where(BatchLine.batch_id == batch_id, BatchLine.state == LineState.PENDING,
                                BatchLine.line_no > after)
                         .order_by(BatchLine.line_no).limit(limit)).all()
    return [PendingLine(n, custom_id, url, orjson.loads(body)) for n, custom_id, url, body in rows]


def record(session_factory: sessionmaker[Session], batch_id: uuid.UUID, line: PendingLine, *, state: LineState,
           status_code: int, body: dict, usage: UsageRecord) -> bool:
    """Answer one line: its result, its ledger row and the counters, together. False (and nothing written)
    when it was answered already."""
    assert state in (LineState.DONE, LineState.FAILED)
    result = orjson.dumps(output_line(batch_id, line.line_no, line.custom_id, status_code, body)).decode()
    with session_factory() as s, s.begin():
        # The batch row first, as `finalize` takes it: the other order deadlocked a record still running on
        # its thread when a cancel's finalize began (an asyncio task's cancel does not stop its thread).
        s.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())
        moved = s.execute(update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.line_no == line.line_no,
                                                  BatchLine.state == LineState.PENDING)
                          .values(state=state, result=result, answered_at=datetime.now(timezone.utc))).rowcount
        if not moved:
            return False
        insert_in(s, usage)
        done = state == LineState.DONE
        s.execute(update(Batch).where(Batch.id == batch_id).values(
            completed=Batch.completed + int(done), failed=Batch.failed + int(not done),
            prompt_tokens=Batch.prompt_tokens + usage.prompt_tokens,
            completion_tokens=Batch.completion_tokens + usage.completion_tokens))
    return True


_SKIP_REASON = {
    BatchStatus.CANCELLED: ("batch_cancelled", "This request was not run: the batch was cancelled."),
    BatchStatus.EXPIRED: ("batch_expired", "This request could not be executed before the completion window expired."),
}


def finalize(session_factory: sessionmaker[Session], store: ObjectStore, batch_id: uuid.UUID) -> BatchStatus:
    """End the batch: unanswered lines are skipped (cancelled or expired), the lines not yet in a part are
    flushed, the output and error files are assembled from the parts and the batch gets its final status, in
    one transaction. Idempotent."""
    with session_factory() as s:
        b = s.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())
        if b.status in TERMINAL:
            final = b.status
            s.commit()
            parts.drop_objects(store, batch_id)  # a run killed between its commit and this left them
            return final
        unanswered = s.scalar(select(BatchLine.line_no).where(BatchLine.batch_id == batch_id,
                                                              BatchLine.state == LineState.PENDING).limit(1))
        final = _final_status(b, unanswered is not None)
        now = datetime.now(timezone.utc)
        if final in _SKIP_REASON:
            code, message = _SKIP_REASON[final]
            for line_no, custom_id in s.execute(select(BatchLine.line_no, BatchLine.custom_id).where(
                    BatchLine.batch_id == batch_id, BatchLine.state == LineState.PENDING)).all():
                s.execute(update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.line_no == line_no).values(
                    state=LineState.SKIPPED, answered_at=now,
                    result=orjson.dumps(output_line(batch_id, line_no, custom_id, 0, None,
                                                    {"code": code, "message": message})).decode()))
        else:
            assert unanswered is None, "a batch completes only when every line is answered"
        b.finalizing_at = b.finalizing_at or now
        parts.flush_all(s, store, batch_id)  # what the runner had not streamed yet, and the skipped lines
        b.output_file_id = parts.assemble(s, store, b, "output")
        b.error_file_id = parts.assemble(s, store, b, "errors")
        b.status = final
        setattr(b, {BatchStatus.COMPLETED: "completed_at", BatchStatus.CANCELLED: "cancelled_at",
                    BatchStatus.EXPIRED: "expired_at"}[final], now)
        s.commit()
    parts.drop_objects(store, batch_id)  # after the commit: until then the parts are the only copy
    return final


def _final_status(b: Batch, unanswered: bool) -> BatchStatus:
    if b.status == BatchStatus.CANCELLING:
        return BatchStatus.CANCELLED
    if unanswered:
        assert b.expires_at <= datetime.now(timezone.utc), "the runner stops early only on cancel or expiry"
        return BatchStatus.EXPIRED
    return BatchStatus.COMPLETED
