"""Fixtures shared by every service's tests: real PostgreSQL and Redis, a migrated database per session.

Everything is lazy: a test that asks for none of these fixtures starts no server and imports no driver.

- `service_urls`: the servers. MPLEX_DATABASE_URL / MPLEX_REDIS_URL when set (CI); otherwise the embedded
  Postgres of the developer's MPLEX_HOME (shared with `make up`, reused across sessions) and a private
  Redis per session (tests may stop, flush or fill it without disturbing anyone else).
- `database_url`: a fresh database `mplex_test_<pid>_<rand>`, migrated with Alembic, dropped afterwards.
- `settings`: MPLEX_* environment pointing at the above (plus a temporary MPLEX_HOME) for this process
  and the children tests start; `stack_env` is that environment as a dict.
- `db`: a Session on the test database; `redis_client`: a client on the test Redis.
Isolation between tests comes from unique rows (the factories in tests/factories.py), not from rollbacks,
so that servers started by a test (gateway, worker) see what the test created.
"""
from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from services.common.cpu_paths import pin

# Before anything imports torch: every machine runs the suite on the same SIMD paths as the kit was built on
# (services/common/cpu_paths.py), so a test calibrated on the kit sees the same numbers on any CI machine.
# Children (engines, workers, gateways) inherit it.
pin()

TEST_DB_PATTERN = re.compile(r"^mplex_test_(\d+)_[0-9a-f]{8}$")


@pytest.fixture(scope="session")
def mplex_home() -> Path:
    """The developer's MPLEX_HOME (embedded Postgres state, demo model cache); never a test's scratch space."""
    from services.common.settings import Settings

    return Settings(env="test").home


@pytest.fixture(scope="session")
def demo_kit(mplex_home: Path):
    """The trained demo kit, cached in the developer's MPLEX_HOME (built by `make model`). Always that home:
    the `settings` fixture points MPLEX_HOME at a scratch dir, where ensure_demo would build it all again."""
    from services.modelkit import ensure_demo

    return ensure_demo(mplex_home, progress=False)


@pytest.fixture(scope="session")
def service_urls(mplex_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from services.common.embedded import EmbeddedRedis, ServiceUrls, default_broker_url, embedded_services
    from services.common.settings import Settings

    configured = Settings(env="test", home=mplex_home)
    with ExitStack() as stack:
        redis_url = configured.redis_url
        if redis_url is None:
            private = EmbeddedRedis(tmp_path_factory.mktemp("redis-state"))
            redis_url = private.start()
            stack.callback(private.stop)
        urls = stack.enter_context(embedded_services(configured.model_copy(update={"redis_url": redis_url})))
        yield ServiceUrls(urls.database_url, redis_url, configured.broker_url or default_broker_url(redis_url))


@pytest.fixture(scope="session")
def database_url(service_urls) -> Iterator[str]:
    """A new database for this session, migrated to head by Alembic (never create_all)."""
    from sqlalchemy import make_url, text

    from services.common.db import make_db_engine
    from services.common.migrate import upgrade

    server = make_url(service_urls.database_url)
    admin = make_db_engine(server.set(database="postgres").render_as_string(hide_password=False),
                        pool_size=1, max_overflow=0, isolation_level="AUTOCOMMIT")
    name = f"mplex_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        with admin.connect() as conn:
            if server.host in ("127.0.0.1", "localhost"):
                _drop_abandoned_test_databases(conn)
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = server.set(database=name).render_as_string(hide_password=False)
        upgrade(url)
        yield url
        from services.common.db import reset_db_engine

        reset_db_engine()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def _drop_abandoned_test_databases(conn) -> None:
    """Databases of sessions that died without cleaning up (same machine: their pid is gone)."""
    from sqlalchemy import text

    for (name,) in conn.execute(text("SELECT datname FROM pg_database WHERE datname LIKE 'mplex_test_%'")):
        m = TEST_DB_PATTERN.match(name)
        if m and not _pid_alive(int(m.group(1))):
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="session")
def stack_env(service_urls, database_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """MPLEX_* for processes a test starts: the test database and Redis, a scratch home."""
    home = tmp_path_factory.mktemp("mplex-home")
    return {
        "MPLEX_ENV": "test",
        "MPLEX_HOME": str(home),
        "MPLEX_DATABASE_URL": database_url,
        "MPLEX_REDIS_URL": service_urls.redis_url,
        "MPLEX_BROKER_URL": service_urls.broker_url,
    }


@pytest.fixture(scope="session")
def settings(stack_env: dict[str, str]) -> Iterator:
    """The process's settings (get_settings()) pointed at the test services for the whole session."""
    from services.common.db import reset_db_engine
    from services.common.settings import get_settings

    with pytest.MonkeyPatch.context() as mp:
        for key, value in stack_env.items():
            mp.setenv(key, value)
        get_settings.cache_clear()
        reset_db_engine()
        yield get_settings()
        reset_db_engine()
        get_settings.cache_clear()


@pytest.fixture(scope="session")
def db_engine(database_url: str) -> Iterator:
    from services.common.db import make_db_engine

    engine = make_db_engine(database_url, pool_size=5, max_overflow=5)
    yield engine
    engine.dispose()


@pytest.fixture
def db(db_engine) -> Iterator:
    from sqlalchemy.orm import Session

    with Session(db_engine, expire_on_commit=False) as session:
        yield session
        session.rollback()


@pytest.fixture
def redis_client(service_urls) -> Iterator:
    import redis

    client = redis.Redis.from_url(service_urls.redis_url, decode_responses=True)
    yield client
    client.close()
