"""Run Alembic migrations from code (`mplex db upgrade`, test fixtures, `make up`) without an alembic.ini."""
from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from services.common.db import make_db_engine


def migrations_dir() -> Path:
    """The repository's migrations/ (editable install or checkout), else ./migrations (container images)."""
    for candidate in (Path(__file__).resolve().parents[2] / "migrations", Path.cwd() / "migrations"):
        if (candidate / "env.py").exists():
            return candidate
    raise FileNotFoundError("migrations/ not found next to the services package or in the working directory")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["database_url"] = url  # not set_main_option: '%' in passwords would be interpolated
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("unused")).get_current_head()


def current_revision(url_or_engine: str | Engine) -> str | None:
    db_engine = make_db_engine(url_or_engine, pool_size=1, max_overflow=0) if isinstance(url_or_engine, str) else url_or_engine
    try:
        with db_engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        if isinstance(url_or_engine, str):
            db_engine.dispose()
