"""`mplex engine serve` as processes: one engine core and N HTTP front-ends, under a small supervisor.

    launcher (this process: supervises, holds nothing)
      ├─ engine core   scheduler, KV, adapters, model, sampler; torch's thread team
      └─ front-end ×N  uvicorn + FastAPI on one shared listening socket: HTTP, tokenize, detokenize,
                       stop strings, NDJSON/SSE; one asyncio thread each

A front-end that dies is started again; the core drops its requests when the new one says `Hello` and goes
on serving the others. One that cannot start (it dies before it ever served, three times running) stops the
engine with a non-zero exit instead of a restart loop that never ends and never serves. A core that dies is
reported by every front-end at once (`/health` says `dead`, its streams end with an engine fault) and the
launcher then stops the front-ends and exits non-zero, so that whatever runs it (`make up`'s supervisor,
Kubernetes) starts a fresh engine. Children die with the launcher
(PR_SET_PDEATHSIG): a SIGKILLed engine leaves no orphan holding its port.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("mplex.engine.launcher")

@dataclass(frozen=True, slots=True)
class FrontendSpec:
    """What each front-end process is built from (picklable: it crosses a spawn)."""

    address: str
    engine_tokens: tuple[str, ...]
    registry_url: str | None  # only front-end 0 heartbeats: one registry entry per engine
    advertise_url: str
    max_body_bytes: int
    max_header_bytes: int
    uvicorn: dict[str, Any]  # uvicorn.Config options (the HTTP protocol class is made in the front-end)
    log_level: str


def run_frontend(index: int, spec: FrontendSpec, sock: socket.socket, ready) -> None:
    from services.engine.process_life import die_with_parent

    die_with_parent()
    import uvicorn

    from services.common.gc_tuning import service_process
    from services.common.http_limits import http_protocol
    from services.common.logging import configure
    from services.engine.core_client import CoreClient
    from services.engine.server import create_app

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # the app's lifespan ran (it met the core) and the socket is served
                ready.set()

    service_process()
    log_config = configure("engine", spec.log_level)
    app = create_app(CoreClient(spec.address, f"frontend-{index}"), engine_tokens=spec.engine_tokens,
                     registry_url=spec.registry_url if index == 0 else None, advertise_url=spec.advertise_url,
                     max_body_bytes=spec.max_body_bytes, max_header_bytes=spec.max_header_bytes)
    config = uvicorn.Config(app, log_config=log_config, http=http_protocol(spec.max_header_bytes), **spec.uvicorn)
    Server(config).run(sockets=[sock])


# How long (libgomp spin iterations, ~20 ns each here) the core's idle OpenMP threads spin before they sleep.
CORE_OMP_SPINCOUNT = 5000


def core_wait_policy(env) -> None:
    """How the core's OpenMP team waits between parallel regions; spawned children inherit it, and an operator's
    own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. Not a long spin (libgomp's default spins ~300k iterations,
    milliseconds): the spinning threads would take the CPU the front-ends need while the core runs its step's
    Python. Not PASSIVE either: a thread asleep between two of a forward's parallel regions (tens of
    microseconds apart) wakes late for every one -- in a 256-stream burst the main thread ran alone a quarter of
    the time (perf sched). A ~0.1 ms spin covers the gaps inside a forward and sleeps through the step's Python: the
    core's loop 2.44-2.81 -> 2.22-2.36 s on a cold burst, ~3% over HTTP (docs/engine.md)."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = str(CORE_OMP_SPINCOUNT)


def serve(engine_config, spec: FrontendSpec, *, host: str, port: int, frontends: int, core_threads: int,
          core_nice: int = 0) -> int:
    """Start the core and the front-ends and supervise them; returns the exit status."""
    from services.engine.core_process import run_core

    core_wait_policy(os.environ)
    ctx = multiprocessing.get_context("spawn")
    run_dir = tempfile.mkdtemp(prefix="mplex-engine-")
    spec = _with_address(spec, f"ipc://{run_dir}/core.sock")
    core = ctx.Process(target=run_core, args=(engine_config, spec.address, core_threads, spec.log_level, core_nice),
                       name="engine-core", daemon=False)
    core.start()
    sock = _listen(host, port)

    def start(i: int) -> _Frontend:
        ready = ctx.Event()
        p = ctx.Process(target=run_frontend, args=(i, spec, sock, ready), name=f"engine-frontend-{i}", daemon=False)
        p.start()
        return _Frontend(p, ready, time.monotonic())

    children = [start(i) for i in range(frontends)]
    log.info("engine core pid %d, front-ends %s on %s:%d", core.pid, [f.proc.pid for f in children], host, port)
    return _supervise(core, children, start)


# A front-end that dies before it ever served is started again START_FAILURES_MAX - 1 times, each after a
# longer pause (START_BACKOFF_S, doubling); then the launcher gives up and exits non-zero, so that its own
# supervisor (`make up`, Kubernetes) sees a broken engine rather than one forever starting. A front-end that
# served and then died is started again at once -- unless it keeps dying within QUICK_DEATH_S of its start:
# then the same doubling pause (at most RESTART_BACKOFF_MAX_S), never giving up, the core serving the others.
START_FAILURES_MAX = 3
START_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
QUICK_DEATH_S = 10.0


@dataclass(slots=True)
class _Frontend:
    proc: Any  # multiprocessing.Process
    ready: Any  # multiprocessing.Event, set once it serves
    started: float  # time.monotonic()


def _supervise(core, frontends: list[_Frontend], start) -> int:
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: stopping.append(s))
    status = 0
    failures = [0] * len(frontends)  # consecutive deaths of each: before serving, or soon after its start
    due: dict[int, float] = {}  # front-ends waiting out a pause before they start again
    while not stopping and status == 0:
        now = time.monotonic()
        timeout = min([0.5, *(max(0.0, t - now) for t in due.values())])
        live = [f.proc.sentinel for i, f in enumerate(frontends) if i not in due]
        ended = multiprocessing.connection.wait([core.sentinel, *live], timeout=timeout)
        if core.sentinel in ended:
            log.error("engine core exited (%s): stopping the front-ends", core.exitcode)
            status = 1
            break
        now = time.monotonic()
        for i, f in enumerate(frontends):
            if stopping or status:
                break
            if i in due:
                if now >= due[i]:
                    del due[i]
                    frontends[i] = start(i)
                continue
            if f.proc.sentinel not in ended:
                continue
            served = f.ready.is_set()
            failures[i] = failures[i] + 1 if not served or now - f.started < QUICK_DEATH_S else 0
            if not served and failures[i] >= START_FAILURES_MAX:
                log.error("front-end %d exited (%s) before it ever served, %d times running: stopping the engine",
                          i, f.proc.exitcode, failures[i])
                status = 1
                break
            pause = min(START_BACKOFF_S * 2 ** (failures[i] - 1), RESTART_BACKOFF_MAX_S) if failures[i] else 0.0
            log.error("front-end %d exited (%s)%s: starting it again in %.1f s; the core goes on", i,
                      f.proc.exitcode, "" if served else " before it served", pause)
            due[i] = now + pause
    procs = [f.proc for i, f in enumerate(frontends) if i not in due]
    for p in procs:  # front-ends first: they leave the registry and finish their streams
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(40)
        if p.is_alive():
            p.kill()
    if core.is_alive():
        core.terminate()
        core.join(15)
        if core.is_alive():
            core.kill()
    return status


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _with_address(spec: FrontendSpec, address: str) -> FrontendSpec:
    from dataclasses import replace

    return replace(spec, address=address)
