"""Pricing one usage row: the gateway's `Pricer` (billed-amount metric, cached price book) and the pure
function behind it. Authoritative amounts come from the daily roll-ups (services.billing.rollup), which
round once per daily row; a single request priced here is rounded once on its own (docs/billing.md).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import datetime
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from services.billing.money import ExactAmounts, RoundedAmounts
from services.billing.pricebook import PriceBook
from services.common.batch_contract import SERVICE_TIER
from services.common.models import Tenant

log = logging.getLogger("mplex.billing.pricing")


class UsageLike(Protocol):
    """The fields of a ledger row (or the gateway's UsageRecord) that pricing reads."""

    tenant_id: uuid.UUID
    base_model: str
    adapter_version_id: uuid.UUID | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    created_at: datetime
    compute_us: int
    # and, where present, `service_tier` ("batch": priced at the batch rate; absent: a live request)


def price_usage(book: PriceBook, plan: str, rec: UsageLike, engine_type: str | None = None) -> RoundedAmounts | None:
    """Amounts for one request at the prices effective at its `created_at`; None if it has no price."""
    prices = book.unit_prices_at(rec.tenant_id, plan, rec.base_model, rec.created_at,
                                 batch=getattr(rec, "service_tier", "default") == SERVICE_TIER)
    if prices is None:
        return None
    exact = ExactAmounts()
    exact.add_usage(prices, rec.prompt_tokens, min(rec.cached_tokens, rec.prompt_tokens), rec.completion_tokens,
                    adapter=rec.adapter_version_id is not None)
    if engine_type is not None and rec.compute_us:
        per_hour = book.engine_price_at(engine_type, rec.created_at)
        if per_hour is not None:
            exact.add_compute(rec.compute_us, per_hour)
    return exact.rounded()


class Pricer:
    """Prices UsageRecords in the gateway's request path: no database round trip on the hot path.

    The price book and tenants' plans are cached in-process for `ttl_s`; a stale cache is refreshed on a
    background thread while the old snapshot keeps answering (the event loop never waits on Postgres,
    except once for a tenant created since the last refresh). It feeds a metric: when prices are missing
    or Postgres is unreachable it answers 0 rather than failing a request whose usage is already metered.
    """

    def __init__(self, session_factory: sessionmaker[Session], ttl_s: float = 5.0):
        self.session_factory = session_factory
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._book: PriceBook | None = None
        self._plans: dict[uuid.UUID, str] = {}
        self._loaded_at = 0.0
        self._refreshing = False

    def price_record(self, rec: UsageLike) -> int:
        """Billed micro-USD for one request (after contract discounts); 0 if it cannot be priced."""
        book, plans = self._snapshot()
        if book is None:
            return 0
        plan = plans.get(rec.tenant_id)
        if plan is None:
            plan = self._tenant_plan(rec.tenant_id)
            if plan is None:
                return 0
        amounts = price_usage(book, plan, rec)
        return amounts.billed_micros if amounts is not None else 0

    def _snapshot(self) -> tuple[PriceBook | None, dict[uuid.UUID, str]]:
        now = time.monotonic()
        if self._book is None:
            self._refresh()  # first use: nothing to serve from yet
        elif now - self._loaded_at > self.ttl_s:
            with self._lock:
                start = not self._refreshing
                self._refreshing = True
            if start:
                threading.Thread(target=self._refresh, name="pricer-refresh", daemon=True).start()
        return self._book, self._plans

    def _refresh(self) -> None:
        try:
            with self.session_factory() as s:
                book = PriceBook.load(s)
                plans = {tid: plan for tid, plan in s.execute(select(Tenant.id, Tenant.plan))}
            self._book, self._plans, self._loaded_at = book, plans, time.monotonic()  # swap whole snapshots
        except SQLAlchemyError as exc:
            log.warning("price book refresh failed (%s); keeping the previous snapshot", exc.__class__.__name__)
            self._loaded_at = time.monotonic()  # do not hammer a database that is down
        finally:
            with self._lock:
                self._refreshing = False

    def _tenant_plan(self, tenant_id: uuid.UUID) -> str | None:
        try:
            with self.session_factory() as s:
                plan = s.scalar(select(Tenant.plan).where(Tenant.id == tenant_id))
        except SQLAlchemyError:
            return None
        if plan is not None:
            self._plans = {**self._plans, tenant_id: plan}
        return plan
