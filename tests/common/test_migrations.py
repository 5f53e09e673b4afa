"""Alembic: an empty database upgrades to head and back to base; head matches the models exactly."""
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from services.common.db import make_db_engine
from services.common.migrate import current_revision, downgrade, head_revision, upgrade
from services.common.models import Base

TRIGGERS = {
    ("usage_events", "usage_events_append_only"),
    ("statements", "statements_append_only"),
    ("statement_lines", "statement_lines_append_only"),
    ("audit_log", "audit_log_append_only"),
    ("adapter_versions", "adapter_versions_immutable"),
}


def public_tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def test_upgrade_empty_to_head_then_down_to_base_and_up_again(empty_database):
    engine = make_db_engine(empty_database, pool_size=1, max_overflow=0)
    try:
        assert public_tables(engine) == set()
        upgrade(empty_database)
        assert current_revision(empty_database) == head_revision()
        assert public_tables(engine) == set(Base.metadata.tables) | {"alembic_version"}

        downgrade(empty_database, "base")
        assert current_revision(empty_database) is None
        assert public_tables(engine) == {"alembic_version"}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM pg_proc WHERE proname LIKE 'mplex_%'")).scalar_one() == 0

        upgrade(empty_database)
        assert current_revision(empty_database) == head_revision()
    finally:
        engine.dispose()


def test_upgrade_twice_is_a_no_op(empty_database):
    upgrade(empty_database)
    upgrade(empty_database)
    assert current_revision(empty_database) == head_revision()


def test_head_matches_the_models(database_url):
    """An autogenerate diff against the migrated database is empty: models and migrations agree."""
    engine = make_db_engine(database_url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            assert compare_metadata(ctx, Base.metadata) == []
    finally:
        engine.dispose()


def test_constraint_names_match_the_models(database_url):
    """Autogenerate ignores CHECK constraints; compare every constraint's name so later migrations can
    drop them by the names the models give."""
    engine = make_db_engine(database_url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT rel.relname, con.conname FROM pg_constraint con "
                "JOIN pg_class rel ON rel.oid = con.conrelid JOIN pg_namespace ns ON ns.oid = rel.relnamespace "
                "WHERE ns.nspname = 'public' AND rel.relname <> 'alembic_version'"
            )).all()
        in_db = {(t, c) for t, c in rows}
        in_models = set()
        for table in Base.metadata.sorted_tables:
            for constraint in table.constraints:
                in_models.add((table.name, str(constraint.name)))
        assert in_db == in_models
    finally:
        engine.dispose()


def test_invariant_triggers_are_installed(database_url):
    engine = make_db_engine(database_url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT event_object_table, trigger_name FROM information_schema.triggers WHERE trigger_schema = 'public'"
            )).all()
        assert {(t, n) for t, n in rows} == TRIGGERS
    finally:
        engine.dispose()


def test_0007_recomputes_the_days_that_already_held_batch_lines(empty_database):
    """Daily rows of (day, tenant) pairs with batch lines are removed and the roll-up cursor moves back to the
    first such ledger row, so the next roll-up splits them by tier; other days are left as they were."""
    upgrade(empty_database, "0006")
    engine = make_db_engine(empty_database, pool_size=1, max_overflow=0)
    try:
        with engine.begin() as conn:
            t = conn.execute(text("INSERT INTO tenants (name, slug) VALUES ('t', 'mig-0007') RETURNING id")).scalar_one()
            for rid, day, tier in (("a", "2026-05-01", "default"), ("b", "2026-05-02", "default"), ("c", "2026-05-02", "batch")):
                conn.execute(text("INSERT INTO usage_events (request_id, tenant_id, model, base_model, prompt_tokens, "
                                  "completion_tokens, status, http_status, created_at, recorded_at, service_tier) VALUES "
                                  "(:r, :t, 'm', 'm', 1, 1, 'ok', 200, :d, :rec, :tier)"),
                             {"r": rid, "t": t, "d": f"{day}T12:00:00Z", "rec": f"{day}T12:00:01Z", "tier": tier})
                conn.execute(text("INSERT INTO usage_daily (day, tenant_id, model, base_model, requests) VALUES "
                                  "(:d, :t, 'm', 'm', 1) ON CONFLICT DO NOTHING"), {"d": day, "t": t})
            conn.execute(text("INSERT INTO billing_cursors (name, recorded_through) VALUES ('usage_daily', '2026-06-01Z')"))
        upgrade(empty_database, "0007")
        with engine.connect() as conn:
            days = conn.execute(text("SELECT day::text, service_tier FROM usage_daily WHERE tenant_id = :t"), {"t": t}).all()
            cursor = conn.execute(text("SELECT recorded_through FROM billing_cursors WHERE name = 'usage_daily'")).scalar_one()
        assert days == [("2026-05-01", "default")]  # the batch day goes, to be recomputed by tier
        assert cursor.isoformat().startswith("2026-05-02T12:00:01")
    finally:
        engine.dispose()
