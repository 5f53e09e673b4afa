"""The price book in memory: effective-dated list prices per (base model, plan), per-tenant contracts,
engine-hour prices per engine type; point-in-time resolution and the time segments roll-ups join against.

Resolution at time t for a tenant on plan P and base model M (docs/billing.md):
1. list price = the (M, P) row with the latest effective_from <= t (none: the usage is unpriced);
2. contract = among the tenant's overrides active at t (effective_from <= t < effective_to), one for M beats
   one for all models; among equals the latest effective_from wins. The winner's explicit prices replace
   the list's column by column (NULL keeps the list price); its discount_bps applies to the whole amount.
"""
from __future__ import annotations

import uuid
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.billing.money import BPS, UnitPrices
from services.common.models import EngineType, Price, TenantPriceOverride

FAR_PAST = datetime(1970, 1, 1, tzinfo=timezone.utc)
FAR_FUTURE = datetime(9999, 12, 31, tzinfo=timezone.utc)
ALL_MODELS = ""  # the segment key of overrides that apply to every base model


@dataclass(frozen=True, slots=True)
class ListPrice:
    base_model: str
    plan: str
    effective_from: datetime
    input: int
    cached_input: int
    output: int
    adapter_surcharge: int
    batch_discount_bps: int = 5000  # the Batch API's rate: this share off batch lines' amount


@dataclass(frozen=True, slots=True)
class Contract:
    tenant_id: uuid.UUID
    base_model: str | None  # None: every base model
    effective_from: datetime
    effective_to: datetime | None
    discount_bps: int | None
    input: int | None
    cached_input: int | None
    output: int | None
    adapter_surcharge: int | None

    def active_at(self, at: datetime) -> bool:
        return self.effective_from <= at and (self.effective_to is None or at < self.effective_to)


@dataclass(frozen=True, slots=True)
class Segment:
    """[start, end) during which one price row (or contract, or engine price) applies to `key`."""

    id: int
    key: tuple
    start: datetime
    end: datetime
    value: object


def unit_prices(lp: ListPrice | None, contract: Contract | None, *, batch: bool = False) -> UnitPrices | None:
    """List price overlaid with a contract; None when some price is unknown (no list row, no explicit price).
    `batch`: a Batch API line, billed at the list row's batch rate on top of any contract discount (the two
    discounts compound; the kept share is rounded down to a whole basis point, in the tenant's favour)."""
    cols = ("input", "cached_input", "output", "adapter_surcharge")
    values = {}
    for c in cols:
        v = getattr(contract, c) if contract is not None else None
        if v is None:
            v = getattr(lp, c) if lp is not None else None
        if v is None:
            return None
        values[c] = v
    discount = contract.discount_bps if contract is not None and contract.discount_bps is not None else 0
    keep = BPS - discount
    if batch:
        keep = keep * (BPS - (lp.batch_discount_bps if lp is not None else 0)) // BPS
    return UnitPrices(**values, keep_bps=keep)


class PriceBook:
    """An immutable snapshot of the price tables."""

    def __init__(self, list_prices: Iterable[ListPrice], contracts: Iterable[Contract], engine_prices: Iterable[tuple[str, datetime, int]]):
        self._list: dict[tuple[str, str], list[ListPrice]] = defaultdict(list)
        for lp in list_prices:
            self._list[(lp.base_model, lp.plan)].append(lp)
        for rows in self._list.values():
            rows.sort(key=lambda r: r.effective_from)
        self._contracts: dict[uuid.UUID, list[Contract]] = defaultdict(list)
        for c in contracts:
            self._contracts[c.tenant_id].append(c)
        self._engine: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
        for name, start, price in engine_prices:
            self._engine[name].append((start, price))
        for rows in self._engine.values():
            rows.sort()

    @classmethod
    def load(cls, session: Session) -> PriceBook:
        lps = [
            ListPrice(p.base_model, p.plan, p.effective_from, p.input_per_mtok_micros, p.cached_input_per_mtok_micros,
                      p.output_per_mtok_micros, p.adapter_surcharge_per_mtok_micros, p.batch_discount_bps)
            for p in session.scalars(select(Price))
        ]
        contracts = [
            Contract(o.tenant_id, o.base_model, o.effective_from, o.effective_to, o.discount_bps, o.input_per_mtok_micros,
                     o.cached_input_per_mtok_micros, o.output_per_mtok_micros, o.adapter_surcharge_per_mtok_micros)
            for o in session.scalars(select(TenantPriceOverride))
        ]
        engines = [(e.name, e.effective_from, e.price_per_hour_micros) for e in session.scalars(select(EngineType))]
        return cls(lps, contracts, engines)

    # -- point in time ---------------------------------------------------------------------------
    def list_price_at(self, base_model: str, plan: str, at: datetime) -> ListPrice | None:
        rows = self._list.get((base_model, plan))
        if not rows:
            return None
        i = bisect_right([r.effective_from for r in rows], at)
        return rows[i - 1] if i else None

    def contract_at(self, tenant_id: uuid.UUID, base_model: str, at: datetime) -> Contract | None:
        active = [c for c in self._contracts.get(tenant_id, ()) if c.active_at(at) and c.base_model in (base_model, None)]
        if not active:
            return None
        return max(active, key=lambda c: (c.base_model is not None, c.effective_from))

    def unit_prices_at(self, tenant_id: uuid.UUID, plan: str, base_model: str, at: datetime, *,
                       batch: bool = False) -> UnitPrices | None:
        return unit_prices(self.list_price_at(base_model, plan, at), self.contract_at(tenant_id, base_model, at), batch=batch)

    def engine_price_at(self, engine_type: str, at: datetime) -> int | None:
        rows = self._engine.get(engine_type)
        if not rows:
            return None
        i = bisect_right([r[0] for r in rows], at)
        return rows[i - 1][1] if i else None

    # -- segments for set-based roll-ups ----------------------------------------------------------
    def list_segments(self, first_id: int = 1) -> list[Segment]:
        """Key (plan, base_model); one segment per list-price row, until the next row."""
        out = []
        for (base_model, plan), rows in sorted(self._list.items()):
            for i, r in enumerate(rows):
                end = rows[i + 1].effective_from if i + 1 < len(rows) else FAR_FUTURE
                out.append(Segment(first_id + len(out), (plan, base_model), r.effective_from, end, r))
        return out

    def contract_segments(self, first_id: int = 1) -> list[Segment]:
        """Key (tenant_id, base_model or ALL_MODELS); the winning contract of each elementary interval.

        Model-specific and all-model contracts get separate segments: the roll-up joins both and prefers
        the specific one, which is exactly `contract_at`'s precedence.
        """
        out: list[Segment] = []
        for tenant_id in sorted(self._contracts, key=str):
            by_key: dict[str, list[Contract]] = defaultdict(list)
            for c in self._contracts[tenant_id]:
                by_key[c.base_model if c.base_model is not None else ALL_MODELS].append(c)
            for key in sorted(by_key):
                contracts = by_key[key]
                bounds = sorted({c.effective_from for c in contracts} | {c.effective_to or FAR_FUTURE for c in contracts})
                for start, end in zip(bounds, bounds[1:]):
                    active = [c for c in contracts if c.active_at(start)]
                    if not active:
                        continue
                    winner = max(active, key=lambda c: c.effective_from)
                    prev = out[-1] if out else None
                    if prev is not None and prev.key == (tenant_id, key) and prev.end == start and prev.value is winner:
                        out[-1] = Segment(prev.id, prev.key, prev.start, end, winner)  # same contract continues
                    else:
                        out.append(Segment(first_id + len(out), (tenant_id, key), start, end, winner))
        return out

    def engine_segments(self, first_id: int = 1) -> list[Segment]:
        out = []
        for name, rows in sorted(self._engine.items()):
            for i, (start, price) in enumerate(rows):
                end = rows[i + 1][0] if i + 1 < len(rows) else FAR_FUTURE
                out.append(Segment(first_id + len(out), (name,), start, end, price))
        return out


# -- writing the price book ---------------------------------------------------------------------------
def set_list_price(
    session: Session, *, base_model: str, plan: str, effective_from: datetime, input: int, cached_input: int, output: int,
    adapter_surcharge: int = 0, created_by: uuid.UUID | None = None, batch_discount_bps: int = 5000,
) -> Price:
    """A new list price from `effective_from` on (rows are never edited: a change is a new row).

    A date in the past re-prices usage already rolled up: run `mplex billing rollup --from ... --to ...`.
    """
    _check_aware(effective_from)
    row = Price(base_model=base_model, plan=plan, effective_from=effective_from, input_per_mtok_micros=input,
                cached_input_per_mtok_micros=cached_input, output_per_mtok_micros=output,
                adapter_surcharge_per_mtok_micros=adapter_surcharge, created_by=created_by,
                batch_discount_bps=batch_discount_bps)
    session.add(row)
    session.flush()
    return row


def set_engine_price(session: Session, *, name: str, effective_from: datetime, price_per_hour: int, description: str | None = None) -> EngineType:
    _check_aware(effective_from)
    row = EngineType(name=name, effective_from=effective_from, price_per_hour_micros=price_per_hour, description=description)
    session.add(row)
    session.flush()
    return row


# Demo prices (micro-USD per 1M tokens; per engine-hour): what `make up` seeds so the dashboards show money.
DEMO_LIST_PRICE = {"input": 200_000, "cached_input": 100_000, "output": 600_000, "adapter_surcharge": 50_000}
DEMO_ENGINE_PRICES = {"cpu": 400_000, "H100": 2_500_000}


def seed_demo_prices(session: Session, *, base_model: str, plans: Iterable[str] = ("default",)) -> int:
    """Idempotent: list prices for plans that have none for `base_model`, engine-hour prices for engine
    types that have none, all effective from 1970. Returns the number of rows added."""
    added = 0
    for plan in plans:
        exists = session.scalar(select(Price.id).where(Price.base_model == base_model, Price.plan == plan).limit(1))
        if exists is None:
            set_list_price(session, base_model=base_model, plan=plan, effective_from=FAR_PAST, **DEMO_LIST_PRICE)
            added += 1
    for name, price in DEMO_ENGINE_PRICES.items():
        if session.scalar(select(EngineType.id).where(EngineType.name == name).limit(1)) is None:
            set_engine_price(session, name=name, effective_from=FAR_PAST, price_per_hour=price, description="demo price")
            added += 1
    return added


def _check_aware(t: datetime) -> None:
    if t.tzinfo is None:
        raise ValueError("effective_from must be timezone-aware (UTC)")
