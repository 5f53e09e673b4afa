"""Alembic environment: online migrations only, serialised by a Postgres advisory lock so that several
replicas starting at once (or two test sessions) never run the same migration twice."""
from __future__ import annotations

from alembic import context
from sqlalchemy import text

from services.common.db import make_db_engine
from services.common.models import Base

# Any constant works; it only has to be the same for every process migrating this database.
MIGRATION_LOCK_ID = 0x6D706C78  # "mplx"


def _database_url() -> str:
    config = context.config
    url = config.attributes.get("database_url") or context.get_x_argument(as_dictionary=True).get("url")
    if url:
        return url
    from services.common.embedded import resolve_urls
    from services.common.settings import get_settings

    return resolve_urls(get_settings()).database_url


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    db_engine = make_db_engine(_database_url(), pool_size=1, max_overflow=0)
    try:
        with db_engine.connect() as conn:
            _run(conn)
    finally:
        db_engine.dispose()


def _run(connection) -> None:
    connection.execute(text("SELECT pg_advisory_lock(:id)"), {"id": MIGRATION_LOCK_ID})
    try:
        context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True, transaction_per_migration=True)
        with context.begin_transaction():
            context.run_migrations()
    finally:
        connection.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": MIGRATION_LOCK_ID})
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported: run against a database")
run_migrations_online()
