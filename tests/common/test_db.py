"""Engine/session helpers and the `mplex db` / `mplex services` commands."""
import os
import subprocess
import sys

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from factories import make_tenant
from services.common.models import Tenant


def test_importing_the_data_layer_connects_to_nothing():
    """With an unreachable database configured, importing db/models/migrate/cli must still succeed."""
    env = {**os.environ, "MPLEX_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none", "MPLEX_REDIS_URL": "redis://127.0.0.1:1/0"}
    code = ("import services.common.db, services.common.models, services.common.migrate, services.common.cli, services.cli;"
            "from services.common.db import get_db_engine; e = get_db_engine(); print(e.url.port)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_session_scope_commits_on_success_and_rolls_back_on_error(settings, db):
    from services.common.db import session_scope

    with session_scope() as s:
        tenant = make_tenant(s, name="scoped")
    assert db.get(Tenant, tenant.id) is not None

    slug = f"rolled-back-{tenant.id.hex[:8]}"
    with pytest.raises(RuntimeError):
        with session_scope() as s:
            s.add(Tenant(name="never", slug=slug))
            s.flush()
            raise RuntimeError("boom")
    assert db.scalar(select(func.count()).select_from(Tenant).where(Tenant.slug == slug)) == 0


def test_settings_fixture_points_the_process_at_the_test_database(settings, database_url):
    from services.common.db import get_db_engine

    assert settings.database_url == database_url.replace("postgresql://", "postgresql+psycopg://")
    assert get_db_engine().url.database == database_url.rsplit("/", 1)[1]
    assert settings.env == "test"


def test_db_cli_reports_and_moves_revisions(database_url):
    from services.common.cli import app
    from services.common.migrate import head_revision

    runner = CliRunner()
    result = runner.invoke(app, ["current", "--url", database_url])
    assert result.exit_code == 0, result.output
    assert f"database: {head_revision()}" in result.output
    result = runner.invoke(app, ["upgrade", "--url", database_url])
    assert result.exit_code == 0 and f"at revision {head_revision()}" in result.output


def test_services_cli_starts_reports_and_stops(tmp_path, monkeypatch):
    from services.common.embedded_cli import app
    from services.common.settings import get_settings

    for key in [k for k in os.environ if k.startswith("MPLEX_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("MPLEX_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        up = runner.invoke(app, ["up"])
        assert up.exit_code == 0, up.output
        env = dict(line.split("=", 1) for line in up.output.strip().splitlines())
        assert set(env) == {"MPLEX_DATABASE_URL", "MPLEX_REDIS_URL", "MPLEX_BROKER_URL"}
        assert '"running": true' in runner.invoke(app, ["status"]).output
    finally:
        down = runner.invoke(app, ["down"])
        get_settings.cache_clear()
    assert down.exit_code == 0
    assert '"running": true' not in runner.invoke(app, ["status"]).output
