"""Billing test helpers: a sessionmaker on the test database, a config, and price-book factories.

Every example uses its own plan name and engine type (`unique(...)`), so price rows never collide with
other tests sharing the session's database.
"""
from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from sqlalchemy.orm import Session, sessionmaker

from services.billing.config import BillingConfig
from services.billing.pricebook import set_engine_price, set_list_price
from services.common.models import TenantPriceOverride
from tests.factories import DEMO_BASE_MODEL, make_base_model, unique

EPOCH = datetime(2020, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def session_factory(db_engine) -> Iterator[sessionmaker[Session]]:
    yield sessionmaker(db_engine, expire_on_commit=False)


@pytest.fixture
def config() -> BillingConfig:
    # No settle lag: tests commit before rolling up; the open-transaction bound still applies.
    return BillingConfig(default_engine_type=unique("eng"), settle_lag_s=0.0)


def make_price(db: Session, *, plan: str, base_model: str = DEMO_BASE_MODEL, effective_from: datetime = EPOCH,
               input: int = 200_000, cached_input: int = 100_000, output: int = 600_000, adapter_surcharge: int = 50_000,
               batch_discount_bps: int = 5000):
    make_base_model(db, name=base_model)
    row = set_list_price(db, base_model=base_model, plan=plan, effective_from=effective_from, input=input,
                         cached_input=cached_input, output=output, adapter_surcharge=adapter_surcharge,
                         batch_discount_bps=batch_discount_bps)
    db.commit()
    return row


def make_engine_price(db: Session, *, name: str, price_per_hour: int, effective_from: datetime = EPOCH):
    row = set_engine_price(db, name=name, effective_from=effective_from, price_per_hour=price_per_hour)
    db.commit()
    return row


def make_contract(db: Session, *, tenant, base_model: str | None = None, effective_from: datetime = EPOCH,
                  effective_to: datetime | None = None, discount_bps: int | None = None, **prices: int | None):
    cols = {f"{k}_per_mtok_micros": v for k, v in prices.items()}
    row = TenantPriceOverride(tenant_id=tenant.id, base_model=base_model, effective_from=effective_from,
                              effective_to=effective_to, discount_bps=discount_bps, **cols)
    db.add(row)
    db.commit()
    return row
