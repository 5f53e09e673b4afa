"""Starts real platform processes for end-to-end tests: engines, the gateway, Celery workers.

Each process runs `python -m services.cli ...` in its own session with the test services' MPLEX_*
environment, logs to a file, and is awaited on its readiness endpoint. Engines and the gateway share one
MPLEX_HOME (or an explicit MPLEX_ENGINE_TOKENS), hence one engine credential; `engine_headers` sends it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str | None
    log: Path
    ready: str | None = None  # its readiness URL
    engine_id: str | None = None  # an engine: ready once registered too

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@dataclass
class Stack:
    env: dict[str, str]
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, ready: str | None = None,
               wait: bool = True, engine_id: str | None = None) -> Proc:
        log = self.log_dir / f"{name}.log"
        full_env = {**os.environ, **self.env, "OMP_NUM_THREADS": "1", **(env or {})}
        popen = subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=full_env,
                                 stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        proc = Proc(name, popen, ready.rsplit("/", 1)[0] if ready else None, log, ready, engine_id)
        self.procs.append(proc)
        if wait:
            self.wait_ready(proc)
        return proc

    def wait_ready(self, *procs: Proc, timeout: float = 180) -> None:
        """Wait for each process's readiness endpoint (and an engine's registration). Processes started with
        `wait=False` and awaited together start side by side: a stack of two engines and a gateway is up in
        the time of its slowest process, not of the three in turn (most of a start-up is imports)."""
        for proc in procs:
            deadline = time.time() + timeout
            while proc.ready:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
                try:
                    if httpx.get(proc.ready, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"{proc.name} not ready in {timeout}s:\n{proc.tail()}")
                time.sleep(0.1)
            if proc.engine_id:
                self.wait_registered(proc.engine_id)

    def engine(self, model_dir: Path, model_name: str, engine_id: str, *, kv_mb: int = 64, max_loras: int = 8,
               extra: list[str] | None = None, wait: bool = True) -> Proc:
        port = free_port()
        return self._spawn(
            engine_id,
            ["engine", "serve", "--model", str(model_dir), "--served-model-name", model_name, "--port", str(port),
             "--engine-id", engine_id, "--kv-memory-mb", str(kv_mb), "--max-loras", str(max_loras), *(extra or [])],
            ready=f"http://127.0.0.1:{port}/health",  # the engine's one open endpoint (the rest need the credential)
            wait=wait, engine_id=engine_id,
        )

    def gateway(self, model_dir: Path, model_name: str, *, env: dict[str, str] | None = None, name: str = "gateway",
                wait: bool = True) -> Proc:
        port = free_port()
        return self._spawn(
            name, ["gateway", "serve", "--port", str(port)],
            env={"MPLEX_BASE_MODEL_DIR": str(model_dir), "MPLEX_BASE_MODEL_NAME": model_name, **(env or {})},
            ready=f"http://127.0.0.1:{port}/ready", wait=wait,
        )

    def worker(self, queues: str, *, name: str = "worker", env: dict[str, str] | None = None, wait: bool = True) -> Proc:
        port = free_port()
        # Two processes whatever the machine: a test worker is the same on a 2-core VM and a 64-core CI host.
        return self._spawn(name, ["worker", "--queues", queues, "--concurrency", "2", "--metrics-port", str(port)], env=env,
                           ready=f"http://127.0.0.1:{port}/ready", wait=wait)

    def engine_headers(self) -> dict[str, str]:
        """The platform credential this stack's engines require (theirs: same env, same home)."""
        from services.common.internal_auth import client_headers
        from services.common.settings import Settings

        env = {**os.environ, **self.env}  # what the children see
        return client_headers(Settings(home=Path(env["MPLEX_HOME"]), engine_tokens=env.get("MPLEX_ENGINE_TOKENS")))

    def wait_registered(self, engine_id: str, timeout: float = 30) -> None:
        r = redis.Redis.from_url(self.env["MPLEX_REDIS_URL"])
        deadline = time.time() + timeout
        while time.time() < deadline:
            if r.get(f"mplex:engine:{engine_id}"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"engine {engine_id} never registered")

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if proc.popen.poll() is None:
            os.killpg(proc.popen.pid, sig)
            try:
                proc.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()

    def close(self) -> None:
        """SIGTERM to every process at once, then wait for each (their graceful shutdowns overlap)."""
        for proc in self.procs:
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()
