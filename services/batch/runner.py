"""Runs one batch: feeds its pending lines to the engines as fast as the pacer allows, checkpoints each
answer, streams the answers to the object store in parts as they come (services.batch.parts), stops on
cancel or expiry, and assembles the output and error files from the parts. Safe to run again at any point
(a resumed runner answers only what is still pending); a second runner of the same batch exits at once."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy import select

from services.adapters.storage import ObjectStore
from services.batch import checkpoint, parts
from services.batch.checkpoint import BatchInfo, PendingLine
from services.batch.execute import Answer, BatchPrincipal, NotRun, answer_line, quota_refusal
from services.batch.pacing import Pacer, PacingConfig
from services.common.batch_contract import TERMINAL
from services.common.cpu_priority import lower_cpu_priority
from services.common.engine_registry import read_snapshots
from services.common.keys import tenant_cache_salt
from services.common.models import Tenant
from services.gateway.batch_files import batch_tokens_left
from services.gateway.state import Gateway, build_gateway

log = logging.getLogger("mplex.batch")
_FETCH = 500  # pending lines read per query
_TICK_S = 0.25  # how often the pacer looks at the engines
_STATUS_EVERY_S = 1.0  # how often the runner looks for a cancel
_QUOTA_EVERY_S = 2.0
_FLUSH_EVERY_S = 2.0  # how often answered lines go out to the object store (and sooner once PART_LINES wait)


def build_context(settings) -> Gateway:
    """The gateway's request-path components (resolver, registry, router, engine client), for this runner."""
    from services.common.embedded import resolve_urls

    urls = resolve_urls(settings)
    model_dir = settings.base_model_dir
    if model_dir is None:
        from services.modelkit import ensure_demo

        model_dir = ensure_demo(settings.home, progress=False).base_dir
    return build_gateway(settings, database_url=urls.database_url, redis_url=urls.redis_url, base_model_dir=model_dir)


def run_batch(batch_id: uuid.UUID, settings) -> str:
    """Run the batch to its end (or until cancelled or expired); returns what happened. It runs on a thread
    of its own at niceness `batch_cpu_nice`: Linux niceness is per thread and inherited by the threads that
    thread starts (the event loop's workers), so the whole run is background work for the OS scheduler while
    the worker's own thread keeps its priority for whatever it runs next."""
    def body() -> str:
        lower_cpu_priority(settings.batch_cpu_nice, who="batch runner")
        return asyncio.run(_run(batch_id, settings))

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mplex-batch") as pool:
        return pool.submit(body).result()


async def _run(batch_id: uuid.UUID, settings) -> str:
    gw = build_context(settings)
    lock_conn = gw.session_factory.kw["bind"].connect()
    try:
        if not checkpoint.try_lock(lock_conn, batch_id):
            return "running elsewhere"
        info = await asyncio.to_thread(checkpoint.start, gw.session_factory, batch_id)
        store = ObjectStore.from_settings(settings)
        if info is None or info.status in TERMINAL:
            if info is not None:  # a run killed after its final commit may have left part objects behind
                await asyncio.to_thread(parts.drop_objects, store, batch_id)
            return "nothing to do"
        run = _Run(gw, info, await asyncio.to_thread(_principal, gw, info), Pacer(PacingConfig.from_settings(settings)),
                   store)
        await run.loop()
        final = await asyncio.to_thread(checkpoint.finalize, gw.session_factory, store, batch_id)
        log.info("batch %s %s", batch_id, final)
        return str(final)
    finally:
        _release(lock_conn, batch_id)
        await gw.aclose()
        gw.session_factory.kw["bind"].dispose()  # this run's pool: one per run, or they pile up in a worker


def _release(lock_conn, batch_id: uuid.UUID) -> None:
    """Give the runner lock back. Closing the connection alone does not: it returns to the pool still holding
    the session's advisory lock, and a retry of this very run then finds the batch "running elsewhere"."""
    try:
        checkpoint.unlock(lock_conn, batch_id)
    except Exception:  # a broken connection: dropping it ends its session, and the lock with it
        log.warning("batch %s: could not release the runner lock; dropping its connection", batch_id, exc_info=True)
        lock_conn.invalidate()
    finally:
        lock_conn.close()


def _principal(gw: Gateway, info: BatchInfo) -> BatchPrincipal:
    with gw.session_factory() as s:
        plan = s.scalar(select(Tenant.plan).where(Tenant.id == info.tenant_id))
    return BatchPrincipal(info.tenant_id, info.api_key_id, plan, tenant_cache_salt(gw.settings.secret(), info.tenant_id))


@dataclass
class _Run:
    gw: Gateway
    info: BatchInfo
    principal: BatchPrincipal
    pacer: Pacer
    store: ObjectStore
    queue: deque[PendingLine] = field(default_factory=deque)
    in_flight: dict[asyncio.Task, PendingLine] = field(default_factory=dict)
    after: int = 0  # the last line number read from the database
    exhausted: bool = False
    retry: list[PendingLine] = field(default_factory=list)  # not run (no engine had room): offered again
    tokens_left: int | None = None
    quota_at: float = 0.0
    status_at: float = 0.0
    answered: int = 0  # lines answered since the last flush began
    flush_at: float = 0.0
    flushing: asyncio.Task | None = None

    async def loop(self) -> None:
        try:
            while not await self._stopping():
                await self._refill()
                if not self.queue and not self.in_flight:
                    if self.exhausted and not self.retry:
                        return
                    self.queue.extend(self.retry)
                    self.retry.clear()
                    await asyncio.sleep(_TICK_S)
                    continue
                await self._start_lines()
                await self._reap()
                self._maybe_flush()
        finally:
            for task in self.in_flight:  # cancel or expiry: abort the lines running (they stay pending)
                task.cancel()
            if self.in_flight:
                await asyncio.gather(*self.in_flight, return_exceptions=True)
            if self.flushing is not None:
                await asyncio.gather(self.flushing, return_exceptions=True)  # finalize flushes what is left

    def _maybe_flush(self) -> None:
        """Stream answered lines to the object store: every _FLUSH_EVERY_S, or once a part's worth waits.
        One flush at a time; a failed one is logged and its lines go out with the next (or with finalize)."""
        if self.flushing is not None:
            if not self.flushing.done():
                return
            if not self.flushing.cancelled() and self.flushing.exception() is not None:
                log.warning("batch %s: a flush to the object store failed", self.info.id, exc_info=self.flushing.exception())
            self.flushing = None
        now = time.monotonic()
        if not self.answered or (self.answered < parts.PART_LINES and now - self.flush_at < _FLUSH_EVERY_S):
            return
        self.answered, self.flush_at = 0, now
        self.flushing = asyncio.create_task(asyncio.to_thread(parts.flush, self.gw.session_factory, self.store, self.info.id))

    async def _stopping(self) -> bool:
        now = time.monotonic()
        if now - self.status_at < _STATUS_EVERY_S:
            return False
        self.status_at = now
        return await asyncio.to_thread(checkpoint.should_stop, self.gw.session_factory, self.info.id)

    async def _refill(self) -> None:
        if self.queue or self.exhausted:
            return
        lines = await asyncio.to_thread(checkpoint.pending, self.gw.session_factory, self.info.id, after=self.after, limit=_FETCH)
        self.queue.extend(lines)
        if lines:
            self.after = lines[-1].line_no
        else:
            self.exhausted = True

    async def _start_lines(self) -> None:
        engines = [e for e in await read_snapshots(self.gw.redis) if e.base_model in self.gw.resolver.bases]
        decision = self.pacer.decide(engines, len(self.in_flight))
        if time.monotonic() - self.quota_at > _QUOTA_EVERY_S:
            self.tokens_left = await asyncio.to_thread(_tokens_left, self.gw, self.info.tenant_id)
            self.quota_at = time.monotonic()
        while self.queue and len(self.in_flight) < decision.limit:
            line = self.queue.popleft()
            self.in_flight[asyncio.create_task(self._answer(line))] = line

    async def _answer(self, line: PendingLine) -> None:
        if self.tokens_left is not None and self.tokens_left <= 0:
            answer: Answer = quota_refusal(self.gw, self.principal, self.info.id, line)
        else:
            try:
                answer = await answer_line(self.gw, self.principal, self.info.id, line)
            except NotRun as exc:
                log.info("batch %s line %d not run (%s); offered again later", self.info.id, line.line_no, exc)
                self.retry.append(line)
                return
        if self.tokens_left is not None:
            self.tokens_left -= answer.usage.prompt_tokens + answer.usage.completion_tokens
        await asyncio.to_thread(checkpoint.record, self.gw.session_factory, self.info.id, line, state=answer.state,
                                status_code=answer.status_code, body=answer.body, usage=answer.usage)

    async def _reap(self) -> None:
        if not self.in_flight:
            await asyncio.sleep(_TICK_S)
            return
        done, _ = await asyncio.wait(self.in_flight, timeout=_TICK_S, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            self.in_flight.pop(task)
            self.answered += 1
            task.result()  # a database error on the money path ends the run (the task retries it)


def _tokens_left(gw: Gateway, tenant_id: uuid.UUID) -> int | None:
    with gw.session_factory() as s:
        return batch_tokens_left(s, tenant_id)
