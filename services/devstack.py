"""`mplex up`: run the platform locally in the foreground; Ctrl-C stops everything it started."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Proc:
    name: str
    argv: list[str]
    ready_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    restart: bool = True  # restarted when it dies (an engine whose step loop stopped exits on purpose)
    restarts: int = 0
    started_at: float = 0.0
    next_start: float | None = None  # set while waiting out a restart backoff


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    """Starts child processes in their own process groups, restarts those that die (with a backoff that
    doubles while a process keeps dying young, like Kubernetes' CrashLoopBackOff), and stops them all, in
    reverse order."""

    BACKOFF_S = 1.0
    MAX_BACKOFF_S = 30.0
    HEALTHY_AFTER_S = 60.0  # a process that lived this long starts again from the shortest backoff

    def __init__(self, log_dir: Path, *, say=print):
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.say = say
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, proc: Proc, timeout: float = 300.0) -> None:
        self._spawn(proc)
        self.procs.append(proc)
        if proc.ready_url:
            self._wait_ready(proc, timeout)

    def _spawn(self, proc: Proc) -> None:
        log = open(self.log_dir / f"{proc.name}.log", "ab")
        env = {**os.environ, **proc.env}
        proc.popen = subprocess.Popen(proc.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        proc.started_at = time.monotonic()
        proc.next_start = None

    def tick(self) -> Proc | None:
        """One pass: schedule restarts of children that died, start those whose backoff is over. Returns a
        child that died and may not be restarted (the caller stops everything), else None."""
        now = time.monotonic()
        for p in self.procs:
            if p.next_start is not None:
                if now >= p.next_start:
                    p.restarts += 1
                    self.say(f">> restarting {p.name} (restart {p.restarts})")
                    self._spawn(p)
                continue
            code = p.popen.poll() if p.popen is not None else None
            if code is None:
                continue
            if not p.restart:
                return p
            young = now - p.started_at < self.HEALTHY_AFTER_S
            delay = min(self.MAX_BACKOFF_S, self.BACKOFF_S * 2 ** min(p.restarts, 8)) if young else self.BACKOFF_S
            if not young:
                p.restarts = 0
            self.say(f"!! {p.name} exited with code {code}; restarting in {delay:.0f}s (log: {self.log_dir / p.name}.log)")
            p.next_start = now + delay
        return None

    def _wait_ready(self, proc: Proc, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; see {self.log_dir / proc.name}.log")
            try:
                if httpx.get(proc.ready_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{proc.name} not ready after {timeout:.0f}s; see {self.log_dir / proc.name}.log")

    def watch(self) -> None:
        """Keep the children running until one that may not be restarted dies, or we are interrupted."""
        while True:
            dead = self.tick()
            if dead is not None:
                self.say(f"!! {dead.name} exited with code {dead.popen.returncode}; stopping (log: {self.log_dir / dead.name}.log)")
                return
            time.sleep(0.5)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.popen and p.popen.poll() is None:
                os.killpg(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in reversed(self.procs):
            if p.popen is None:
                continue
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)


def mplex_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def write_dev_json(home: Path, info: dict) -> Path:
    path = home / "dev.json"
    path.write_text(json.dumps(info, indent=2) + "\n")
    os.chmod(path, 0o600)
    return path


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def seed_dev_database(database_url: str, kit, existing_key: str | None = None):
    """Migrate to head and seed what `mplex up` serves: the demo tenant, users and key, the base model's
    row, and the demo price book (which references that row). Idempotent; returns the seed."""
    from services.adapters.base_model import ensure_base_model
    from services.billing.pricebook import seed_demo_prices
    from services.common.db import make_db_engine, make_sessionmaker, session_scope
    from services.common.migrate import upgrade
    from services.gateway.seed import seed_demo

    upgrade(database_url)
    db_engine = make_db_engine(database_url, pool_size=1, max_overflow=0)
    try:
        with session_scope(make_sessionmaker(db_engine)) as s:
            seed = seed_demo(s, existing_key=existing_key)
            ensure_base_model(s, name=kit.model_name, model_dir=kit.base_dir)
            seed_demo_prices(s, base_model=kit.model_name, plans=("default",))
    finally:
        db_engine.dispose()
    return seed


def run_up(home: Path) -> None:
    """Embedded Postgres + Redis, migrations, demo seed, two engines, a Celery worker + beat, the
    gateway serving the web app. Prints how to use it and writes it all to <home>/dev.json."""
    from services.common.embedded import embedded_services
    from services.common.settings import Settings
    from services.modelkit import ensure_demo

    kit = ensure_demo(home)
    settings = Settings(home=home)
    previous = _read_json(home / "dev.json")
    sup = Supervisor(home / "logs")
    signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C stops everything even when we were started with SIGINT ignored (a shell's background job
    # inherits that, and Python then never raises KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(">> starting embedded PostgreSQL and Redis", flush=True)
    with embedded_services(settings) as urls:
        try:
            seed = seed_dev_database(urls.database_url, kit, existing_key=previous.get("api_key"))
            os.environ.update(urls.as_env())  # in-process helpers below (adapter seeding) see the same servers
            env = {**urls.as_env(), "MPLEX_HOME": str(home), "MPLEX_BASE_MODEL_DIR": str(kit.base_dir),
                   "MPLEX_BASE_MODEL_NAME": kit.model_name, "OMP_NUM_THREADS": "1"}
            engines = []
            for i in range(2):
                port = free_port()
                print(f">> starting engine-{i}", flush=True)
                sup.start(Proc(f"engine-{i}", mplex_argv("engine", "serve", "--model", str(kit.base_dir),
                                                           "--served-model-name", kit.model_name, "--port", str(port),
                                                           "--engine-id", f"engine-{i}", "--kv-memory-mb", "256"),
                               ready_url=f"http://127.0.0.1:{port}/health", env=env))  # its one open endpoint
                engines.append(f"http://127.0.0.1:{port}")
            print(">> starting the Celery worker and beat", flush=True)
            worker_port = free_port()
            sup.start(Proc("worker", mplex_argv("worker", "--queues", "adapters.ingest,adapters.eval,billing,batches",
                                                "--metrics-port", str(worker_port)),
                           ready_url=f"http://127.0.0.1:{worker_port}/ready", env=env))
            sup.start(Proc("beat", mplex_argv("beat"), env=env))
            gw_port = 8000 if _port_free(8000) else free_port()
            print(">> starting the gateway", flush=True)
            sup.start(Proc("gateway", mplex_argv("gateway", "serve", "--port", str(gw_port)),
                           ready_url=f"http://127.0.0.1:{gw_port}/ready", env=env))
            url = f"http://127.0.0.1:{gw_port}"
            adapters = _seed_adapters(seed.tenant_slug, kit, home)
            info = {
                "gateway_url": url,
                "base_url": f"{url}/v1",
                "web_url": url + "/",
                "model": kit.model_name,
                "api_key": seed.api_key,
                **seed.as_dict(),
                "admin": next(({"email": u.email, "password": u.password} for u in seed.users if str(u.role) == "platform_admin"), None),
                "adapters": adapters,
                "engines": engines,
                "worker_metrics": f"http://127.0.0.1:{worker_port}/metrics",
                "database_url": urls.database_url,
                "redis_url": urls.redis_url,
            }
            path = write_dev_json(home, info)
            _print_banner(info, path)
            sup.watch()
        except KeyboardInterrupt:
            print("\nstopping…", flush=True)
        finally:
            sup.stop()


def _seed_adapters(tenant: str, kit, home: Path) -> dict[str, str]:
    """Upload the demo adapters through the real pipeline (validation + quality gate on the worker).
    Returns name -> version status at the time of the banner; the web app shows them progress to ready."""
    from services.adapters.seed import seed_demo_adapters
    from services.common.settings import Settings

    print(">> seeding the demo adapters through the upload pipeline (the worker validates and gates them)", flush=True)
    try:
        seeded = seed_demo_adapters(tenant=tenant, kit=kit, settings=Settings(home=home))
    except Exception as exc:  # the platform is still usable without them; say why
        print(f"!! seeding demo adapters failed: {exc}", flush=True)
        return {}
    return {a.name: str(a.status) for a in seeded}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _print_banner(info: dict, path: Path) -> None:
    url, model, key = info["gateway_url"], info["model"], info["api_key"]
    users = "\n".join(f"    {u['role']:<15} {u['email']} / {u['password']}" for u in info["users"])
    print(
        f"""
Multiplex is up.
  gateway (OpenAI API):  {url}/v1      model: {model}
  web app:               {url}/
  demo API key:          {key}
  sign-in (dev passwords):
{users}
  connection info:       {path}

  curl {url}/v1/chat/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{key}'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello'}}]).choices[0].message.content)"

Logs: {path.parent / 'logs'}.  Ctrl-C stops everything.""",
        flush=True,
    )
