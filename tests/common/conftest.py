"""Fixtures of the tests/common suite."""
import uuid

import pytest
from sqlalchemy import make_url, text

from services.common.db import make_db_engine


@pytest.fixture
def empty_database(service_urls):
    """A new, empty database on the session's server (not migrated); dropped afterwards."""
    server = make_url(service_urls.database_url)
    admin = make_db_engine(server.set(database="postgres").render_as_string(hide_password=False),
                        pool_size=1, max_overflow=0, isolation_level="AUTOCOMMIT")
    name = f"mplex_empty_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield server.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()
