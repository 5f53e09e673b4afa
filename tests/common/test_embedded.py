"""Embedded PostgreSQL and Redis: real servers, shared by processes, reused, stopped by the last lease holder."""
import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import redis

from services.common.embedded import (
    EmbeddedPostgres,
    EmbeddedRedis,
    embedded_services,
    embedded_status,
    resolve_urls,
    stop_embedded,
)
from services.common.settings import Settings

pytestmark = pytest.mark.timeout(300)

# Run in a child process: what another service (gateway, worker) would do on start-up.
RESOLVE = """
import json, os, sys
from services.common.embedded import resolve_urls, embedded_status
from services.common.settings import Settings
s = Settings(env="test", home=sys.argv[1])
u = resolve_urls(s)
st = embedded_status(s.state_dir)
print(json.dumps({"db": u.database_url, "redis": u.redis_url, "pg_pid": st["postgres"]["pid"], "redis_pid": st["redis"]["pid"]}))
"""


@pytest.fixture(autouse=True)
def no_configured_services(monkeypatch):
    """These tests are about the embedded default: ignore MPLEX_* set by a session fixture or CI."""
    for key in [k for k in os.environ if k.startswith("MPLEX_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def home(tmp_path):
    home = tmp_path / "home"
    yield home
    stop_embedded(home / "state")


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def assert_real(database_url: str, redis_url: str) -> None:
    with psycopg.connect(libpq(database_url)) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert conn.execute("SHOW server_version_num").fetchone()[0] >= "150000"
        assert conn.execute("SHOW timezone").fetchone() == ("UTC",)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.ping()
        client.set("mplex:test:key", "v", ex=5)
        assert client.get("mplex:test:key") == b"v"
    finally:
        client.close()


def resolve_in_child(home: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RESOLVE, str(home)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_asking_at_once_get_the_same_real_servers(home):
    procs = [resolve_in_child(home) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert results[0] == results[1]
    assert results[0]["pg_pid"] and results[0]["redis_pid"]
    assert_real(results[0]["db"], results[0]["redis"])
    # The servers outlive the processes that started them, and a later process reuses them.
    later = resolve_in_child(home)
    out, err = later.communicate(timeout=240)
    assert later.returncode == 0, err
    assert json.loads(out) == results[0]


def test_configured_urls_are_used_as_given_and_nothing_starts(home):
    s = Settings(env="test", home=home, database_url="postgresql://u@db.internal/x", redis_url="redis://cache:6379/2")
    urls = resolve_urls(s)
    assert urls.database_url == "postgresql+psycopg://u@db.internal/x"
    assert urls.redis_url == "redis://cache:6379/2" and urls.broker_url == "redis://cache:6379/3"
    assert not (home / "state" / "pg").exists() and not (home / "state" / "redis").exists()


def test_restart_keeps_port_and_data(tmp_path):
    pg = EmbeddedPostgres(tmp_path / "state")
    url = pg.start()
    try:
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (v int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        pg.stop()
        assert not pg.is_running()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(libpq(url), connect_timeout=2)
        assert pg.start() == url
        with psycopg.connect(libpq(url)) as conn:
            assert conn.execute("SELECT v FROM kept").fetchone() == (42,)
    finally:
        pg.stop()


def test_redis_restart_keeps_port_and_appended_data(tmp_path):
    rd = EmbeddedRedis(tmp_path / "state")
    url = rd.start()
    try:
        client = redis.Redis.from_url(url)
        client.set("persisted", "yes")
        client.close()
        rd.stop()
        assert not rd.is_running()
        assert rd.start() == url
        client = redis.Redis.from_url(url)
        assert client.get("persisted") == b"yes"
        client.close()
    finally:
        rd.stop()


def test_last_lease_holder_stops_the_servers_it_started(home):
    s = Settings(env="test", home=home)
    with embedded_services(s) as urls:
        assert_real(urls.database_url, urls.redis_url)
        with embedded_services(s) as inner:  # a second holder (same process here, e.g. nested tooling)
            assert inner == urls
        status = embedded_status(s.state_dir)
        assert status["postgres"]["running"] and status["redis"]["running"]
    status = embedded_status(s.state_dir)
    assert not status["postgres"]["running"] and not status["redis"]["running"]


def test_a_lease_held_by_another_live_process_keeps_servers_up(home):
    s = Settings(env="test", home=home)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from services.common.embedded import embedded_services\n"
         "from services.common.settings import Settings\n"
         f"with embedded_services(Settings(env='test', home={str(home)!r})):\n"
         "    print('up', flush=True)\n"
         "    sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "up"
        with embedded_services(s) as urls:
            pass
        assert_real(urls.database_url, urls.redis_url)  # we left, they still hold a lease
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)
    assert holder.returncode == 0
    assert not embedded_status(s.state_dir)["postgres"]["running"]  # the last holder stopped them


def test_servers_started_by_services_up_are_not_stopped_by_leases(home):
    from services.common.embedded import start_embedded

    s = Settings(env="test", home=home)
    urls = start_embedded(s.state_dir)
    with embedded_services(s) as leased:
        assert leased.database_url == urls.database_url
    assert_real(urls.database_url, urls.redis_url)
