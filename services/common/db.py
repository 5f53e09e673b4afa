"""The database: SQLAlchemy engine ("db engine": never an inference engine) and sessions (psycopg 3). Nothing connects at import: engines are built on first use."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from services.common.settings import Settings, get_settings, normalize_database_url


def make_db_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20, **kwargs: object) -> Engine:
    """An engine for `url` (any Postgres scheme; the psycopg 3 driver is always used).

    pool_pre_ping: a connection that died with a Postgres restart is replaced instead of failing a request.
    """
    return create_engine(
        normalize_database_url(url),
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_pre_ping=True,
        connect_args={"connect_timeout": 10},
        **kwargs,
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: rows returned from a committed unit of work stay readable (API responses).
    return sessionmaker(engine, expire_on_commit=False)


@lru_cache(maxsize=1)
def get_db_engine() -> Engine:
    """The process-wide engine for the settings' database (the embedded one if none is configured)."""
    return db_engine_from_settings(get_settings())


def db_engine_from_settings(settings: Settings) -> Engine:
    from services.common.embedded import resolve_urls  # starts embedded servers only if asked to

    url = settings.database_url or resolve_urls(settings).database_url
    return make_db_engine(url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow)


@lru_cache(maxsize=1)
def _default_sessionmaker() -> sessionmaker[Session]:
    return make_sessionmaker(get_db_engine())


@contextmanager
def session_scope(factory: sessionmaker[Session] | None = None) -> Iterator[Session]:
    """One unit of work: commits when the block succeeds, rolls back (and re-raises) when it fails."""
    session = (factory or _default_sessionmaker())()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def reset_db_engine() -> None:
    """Forget the cached engine (after MPLEX_DATABASE_URL changed, e.g. between test sessions)."""
    if get_db_engine.cache_info().currsize:
        get_db_engine().dispose()
    get_db_engine.cache_clear()
    _default_sessionmaker.cache_clear()
