"""`mplex up` seeds a brand-new database: a fresh machine has no rows at all (the price book references the
base model's row, which nothing else creates before the first adapter upload)."""
from sqlalchemy import func, select

from services.common.db import make_db_engine
from services.common.models import BaseModelRecord, Price, Tenant, TenantLimits
from services.devstack import seed_dev_database
from services.gateway.seed import DEMO_SLUG


def test_a_fresh_database_is_seeded_and_a_second_run_reuses_the_key(empty_database, demo_kit):
    first = seed_dev_database(empty_database, demo_kit)
    assert first.api_key.startswith("mpx_")
    again = seed_dev_database(empty_database, demo_kit, existing_key=first.api_key)
    assert again.api_key == first.api_key
    engine = make_db_engine(empty_database, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(BaseModelRecord)
                               .where(BaseModelRecord.name == demo_kit.model_name)) == 1
            assert conn.scalar(select(func.count()).select_from(Price)
                               .where(Price.base_model == demo_kit.model_name, Price.plan == "default")) == 1
            limits = conn.execute(select(TenantLimits).join(Tenant).where(Tenant.slug == DEMO_SLUG)).one()
            assert None not in (limits.tokens_per_min, limits.requests_per_min, limits.concurrent_requests,
                                limits.monthly_token_budget)  # the demo tenant is metered like any other
    finally:
        engine.dispose()
