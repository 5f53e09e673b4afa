"""Exactly-once usage metering: one ledger row per request, even when Postgres is briefly down.

The gateway hands a `UsageRecord` over when a request ends (completed, cancelled or failed). It is
inserted idempotently (the request id is unique); if Postgres is unreachable it goes to a durable
local spool first, and a replay loop inserts it when the database is back. Nothing lost, nothing doubled.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from services.common.models import UsageEvent
from services.gateway.spool import Spool

log = logging.getLogger("mplex.gateway.metering")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one request used; the billing service prices these rows."""

    request_id: str
    tenant_id: uuid.UUID
    api_key_id: uuid.UUID | None
    model: str
    base_model: str
    adapter_version_id: uuid.UUID | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: str  # ok | cancelled | error
    http_status: int
    created_at: datetime
    error_code: str | None = None
    client_request_id: str | None = None
    started_ms: int | None = None
    first_token_ms: int | None = None
    finished_ms: int | None = None
    engine_id: str | None = None
    compute_us: int = 0
    service_tier: str = "default"  # "batch": a Batch API line (services.common.batch_contract.SERVICE_TIER)

    def to_row(self) -> dict:
        # Shallow: every field is immutable (asdict deep-copied each UUID and datetime, per request on the hot path).
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    def to_json(self) -> dict:
        d = self.to_row()
        for k in ("tenant_id", "api_key_id", "adapter_version_id"):
            d[k] = str(d[k]) if d[k] is not None else None
        d["created_at"] = self.created_at.isoformat()
        return d

    @staticmethod
    def row_from_json(d: dict) -> dict:
        row = dict(d)
        for k in ("tenant_id", "api_key_id", "adapter_version_id"):
            row[k] = uuid.UUID(row[k]) if row.get(k) else None
        row["created_at"] = datetime.fromisoformat(row["created_at"])
        return row


_FIELD_NAMES = tuple(f.name for f in fields(UsageRecord))


_INSERT = insert(UsageEvent.__table__).on_conflict_do_nothing(index_elements=["request_id"])


def insert_in(session: Session, rec: UsageRecord) -> bool:
    """Insert one record in the caller's transaction (the batch runner commits it with the line's answer);
    True when it was new."""
    return bool(session.execute(_INSERT, [rec.to_row()]).rowcount)


def insert_rows(session_factory: sessionmaker[Session], rows: list[dict]) -> int:
    """Idempotent multi-row insert (Core, not the ORM's bulk machinery); returns how many rows were new."""
    if not rows:
        return 0
    with session_factory() as session:
        # executemany of one cached statement (SQLAlchemy batches it into multi-row VALUES itself)
        result = session.execute(_INSERT, rows)
        session.commit()
        return result.rowcount or 0


class Meter:
    """Records usage. Concurrent `record` calls are coalesced into one multi-row INSERT (group commit):
    each caller still waits until its own row is in Postgres or in the fsynced spool."""

    def __init__(self, session_factory: sessionmaker[Session], spool_dir: Path, metrics=None,
                 replay_interval_s: float = 2.0, max_batch: int = 256, linger_s: float = 0.01):
        self.session_factory = session_factory
        self.spool = Spool(spool_dir)
        self.metrics = metrics
        self.replay_interval_s = replay_interval_s
        self.max_batch = max_batch
        self.linger_s = linger_s  # wait this long for company: one commit then serves many requests
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._pending: list[tuple[UsageRecord, asyncio.Future]] = []
        self._flushing = False

    async def record(self, rec: UsageRecord) -> str:
        """Land the record in the ledger, or durably in the spool. Returns "ledger" or "spool"."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((rec, fut))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        try:
            while self._pending:
                if len(self._pending) < self.max_batch:
                    await asyncio.sleep(self.linger_s)
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                try:
                    via = await asyncio.to_thread(self._write, [rec for rec, _ in batch])
                except Exception as exc:  # handed to every waiting caller; nothing is swallowed
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                if self.metrics is not None:
                    self.metrics.ledger_writes.labels(via=via).inc(len(batch))
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(via)
        finally:
            self._flushing = False

    def _write(self, recs: list[UsageRecord]) -> str:
        try:
            insert_rows(self.session_factory, [r.to_row() for r in recs])
            return "ledger"
        except DBAPIError as exc:
            if not (isinstance(exc, OperationalError) or exc.connection_invalidated):
                raise  # a data error is a bug, not an outage: never hide it in the spool
            log.warning("ledger unreachable (%s); spooling %d usage events", exc.__class__.__name__, len(recs))
            for r in recs:
                self.spool.append(r.to_json())
            return "spool"

    def replay_once(self) -> int:
        def insert(batch: list[dict]) -> None:
            insert_rows(self.session_factory, [UsageRecord.row_from_json(d) for d in batch])

        return self.spool.replay(insert)

    async def run_replay(self) -> None:
        """Background loop: drain the spool whenever it has events and Postgres answers."""
        while not self._stop.is_set():
            try:
                depth = await asyncio.to_thread(self.spool.depth)
                if self.metrics is not None:
                    self.metrics.spool_depth.set(depth)
                if depth:
                    n = await asyncio.to_thread(self.replay_once)
                    log.info("replayed %d spooled usage events into the ledger", n)
            except DBAPIError as exc:
                if not (isinstance(exc, OperationalError) or exc.connection_invalidated):
                    log.exception("spool replay failed on a data error; events stay spooled")
                # else: still down; try again next tick
            try:
                await asyncio.wait_for(self._stop.wait(), self.replay_interval_s)
            except asyncio.TimeoutError:
                pass

    def start(self) -> None:
        self._task = asyncio.create_task(self.run_replay())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
