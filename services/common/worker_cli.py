"""`mplex worker` and `mplex beat`: run the shared Celery app's worker (with Prometheus metrics, /health and
/ready on its own port) and its beat scheduler.

Metrics on 127.0.0.1:9100 by default (Kubernetes passes the pod IP as MPLEX_WORKER_METRICS_HOST so probes and
scrapes reach it): `mplex_worker_tasks_total{task,state}` (state: started, success, failure, retry),
`mplex_worker_task_duration_seconds{task}` and `mplex_worker_queue_depth{queue}` (messages waiting
in the broker, read at scrape time). Tasks run in prefork child processes, so their counters go through
prometheus_client's multiprocess mode (a private directory per worker) and the parent serves the sum.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import typer

from services.common.celery_app import QUEUES

app = typer.Typer(add_completion=False, help="Run a Celery worker (queues: " + ", ".join(QUEUES) + ").")
beat_app = typer.Typer(add_completion=False, help="Run the Celery beat scheduler (periodic billing tasks).")

log = logging.getLogger("mplex.worker")

DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800, 3600)


@app.callback(invoke_without_command=True)
def worker(
    queues: str = typer.Option(",".join(QUEUES), help="Comma-separated queues to consume"),
    concurrency: int = typer.Option(None, help="Worker processes (default: number of CPUs)"),
    pool: str = typer.Option("prefork", help="prefork | threads | solo"),
    metrics_port: int = typer.Option(9100, envvar="MPLEX_WORKER_METRICS_PORT", help="Port for /metrics, /health, /ready"),
    metrics_host: str = typer.Option("127.0.0.1", envvar="MPLEX_WORKER_METRICS_HOST", help="Address for the metrics port (Kubernetes passes the pod IP)"),
    loglevel: str = typer.Option("info", help="Log level"),
) -> None:
    """Consume tasks from QUEUES until stopped (SIGTERM: warm shutdown, running tasks finish)."""
    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(wanted) - set(QUEUES))
    if not wanted or unknown:
        raise typer.BadParameter(f"unknown queue(s) {unknown}; known: {', '.join(QUEUES)}", param_hint="--queues")
    run_worker(wanted, concurrency=concurrency, pool=pool, metrics_host=metrics_host, metrics_port=metrics_port, loglevel=loglevel)


@beat_app.callback(invoke_without_command=True)
def beat(
    schedule: str = typer.Option(None, help="Schedule state file (default: <MPLEX_HOME>/state/celerybeat-schedule)"),
    loglevel: str = typer.Option("info", help="Log level"),
) -> None:
    """Send the periodic billing tasks on schedule. Run exactly one beat per deployment."""
    from services.common.celery_app import app as celery
    from services.common.settings import get_settings

    from services.common.celery_app import beat_schedule

    path = schedule or str(get_settings().state_dir / "celerybeat-schedule")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    celery.conf.beat_schedule = beat_schedule()
    celery.Beat(schedule=path, loglevel=loglevel.upper()).run()


# -- the worker ---------------------------------------------------------------------------------------
def run_worker(queues: list[str], *, concurrency: int | None, pool: str, metrics_host: str, metrics_port: int, loglevel: str) -> None:
    metrics_dir = tempfile.mkdtemp(prefix="mplex-worker-metrics-")
    # Must be set before any metric exists: prometheus_client picks its value store from it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from prometheus_client import values

    values.ValueClass = values.get_value_class()

    from services.common.celery_app import app as celery

    # Loads the lazy configuration here, before the HTTP thread's /ready can touch it: Celery evaluates it
    # without a lock, and a probe racing the worker's own first read could leave it on the default broker.
    _check_configured(celery, queues)
    state = _WorkerState(queues)
    _install_task_metrics()
    server = _serve_http(celery, state, metrics_host, metrics_port, metrics_dir)
    _connect_lifecycle(state, server)
    argv = ["worker", f"--queues={','.join(queues)}", f"--pool={pool}", f"--loglevel={loglevel.upper()}", "--without-gossip",
            "--without-mingle", f"--hostname=mplex-{'-'.join(queues)}-{os.getpid()}@%h"]
    if concurrency:
        argv.append(f"--concurrency={concurrency}")
    try:
        celery.worker_main(argv)
    finally:
        server.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _check_configured(celery, queues: list[str]) -> None:
    """Refuse to start a worker that would consume nothing: every queue has its tasks registered and the
    broker is the configured one (a configuration that failed to load leaves Celery's defaults -- an AMQP
    broker on localhost -- and a worker that looks ready while uploads wait forever)."""
    from services.common.celery_app import celery_config

    celery.loader.import_default_modules()
    expected = celery_config()["broker_url"]
    if celery.conf.broker_url != expected:
        raise RuntimeError(f"Celery is configured for broker {celery.conf.broker_url!r}, not {expected!r}")
    empty = [q for q in queues if not any(name.startswith(q + ".") for name in celery.tasks)]
    if empty:
        raise RuntimeError(f"no tasks registered for queue(s) {empty}; registered: {sorted(celery.tasks)}")


class _WorkerState:
    def __init__(self, queues: list[str]):
        self.queues = queues
        self.ready = threading.Event()
        self.stopping = threading.Event()


def _install_task_metrics() -> None:
    """Count and time tasks in whichever process runs them (prefork children write their own files)."""
    from celery import signals
    from prometheus_client import Counter, Histogram

    tasks = Counter("mplex_worker_tasks", "Tasks by name and state", ["task", "state"])
    duration = Histogram("mplex_worker_task_duration_seconds", "Task run time", ["task"], buckets=DURATION_BUCKETS)
    started: dict[str, float] = {}

    def prerun(task_id=None, task=None, **_):
        started[task_id] = time.perf_counter()
        tasks.labels(task=task.name, state="started").inc()

    def postrun(task_id=None, task=None, state=None, **_):
        t0 = started.pop(task_id, None)
        if t0 is not None:
            duration.labels(task=task.name).observe(time.perf_counter() - t0)
        tasks.labels(task=task.name, state=(state or "unknown").lower()).inc()

    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)


def _connect_lifecycle(state: _WorkerState, server: ThreadingHTTPServer) -> None:
    from celery import signals
    from prometheus_client import multiprocess

    def on_ready(**_):
        state.ready.set()
        log.info("worker ready: queues=%s", ",".join(state.queues))

    def on_shutdown(**_):
        state.stopping.set()

    def in_child(**_):
        server.socket.close()  # the forked child's copy of the listening socket: only the parent serves

    def child_gone(pid=None, **_):
        if pid is not None:
            multiprocess.mark_process_dead(pid)

    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutdown, weak=False)
    signals.worker_process_init.connect(in_child, weak=False)
    signals.worker_process_shutdown.connect(child_gone, weak=False)


class QueueDepthCollector:
    """mplex_worker_queue_depth{queue}: messages waiting in the broker, read at scrape time."""

    def __init__(self, celery, queues: tuple[str, ...] = QUEUES):
        self.celery = celery
        self.queues = queues

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("mplex_worker_queue_depth", "Messages waiting in the broker per queue", labels=["queue"])
        for queue, depth in queue_depths(self.celery, self.queues).items():
            family.add_metric([queue], depth)
        yield family


def queue_depths(celery, queues: tuple[str, ...] = QUEUES) -> dict[str, int]:
    """Messages waiting per queue (a queue never declared on the broker has none)."""
    from kombu.exceptions import ChannelError

    out = {}
    with celery.connection_for_read() as conn:
        channel = conn.default_channel
        for q in queues:
            try:
                out[q] = int(channel.queue_declare(queue=q, passive=True).message_count)
            except ChannelError:
                out[q] = 0
    return out


def database_reachable() -> bool:
    """A fresh connection per probe: the parent keeps no pooled sockets for its prefork children to inherit."""
    import psycopg

    from services.common.embedded import resolve_urls
    from services.common.settings import get_settings

    settings = get_settings()
    url = settings.database_url or resolve_urls(settings).database_url
    try:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def broker_reachable(celery) -> bool:
    try:
        with celery.connection_for_read() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=2)
        return True
    except Exception:  # any failure means "not reachable"; /ready reports it instead of raising
        return False


# The pool forks its task processes while this process's metrics thread may be answering /ready, which
# connects to the broker and to Postgres. A child forked in the middle of that inherits libpq's and the
# clients' locks held by a thread that does not exist in it, and hangs on its first database connection (seen:
# an upload's validate task running for minutes). So a fork waits for the probe in flight, and a probe
# waits for the fork.
_NO_FORK_WHILE_PROBING = threading.Lock()
os.register_at_fork(before=_NO_FORK_WHILE_PROBING.acquire, after_in_parent=_NO_FORK_WHILE_PROBING.release,
                    after_in_child=_NO_FORK_WHILE_PROBING.release)


def _serve_http(celery, state: _WorkerState, host: str, port: int, metrics_dir: str) -> ThreadingHTTPServer:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    registry.register(QueueDepthCollector(celery))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._send(200, "application/json", {"status": "ok"})
            elif self.path == "/ready":
                with _NO_FORK_WHILE_PROBING:
                    checks = {"consuming": state.ready.is_set() and not state.stopping.is_set(),
                              "broker": broker_reachable(celery), "database": database_reachable()}
                self._send(200 if all(checks.values()) else 503, "application/json", {"ready": all(checks.values()), "checks": checks,
                                                                                      "queues": state.queues})
            elif self.path == "/metrics":
                try:
                    with _NO_FORK_WHILE_PROBING:  # queue depths are read from the broker
                        body = generate_latest(registry)
                except Exception as exc:  # e.g. the broker is down while reading queue depths: say so, 503
                    self._send(503, "text/plain", f"metrics unavailable: {exc.__class__.__name__}: {exc}".encode())
                    return
                self._send(200, CONTENT_TYPE_LATEST, body)
            else:
                self._send(404, "application/json", {"error": "not found"})

        def _send(self, status: int, ctype: str, body) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # scrapes every few seconds would drown the worker's log
            pass

    server = (_ThreadingHTTPServerV6 if ":" in host else ThreadingHTTPServer)((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="worker-metrics", daemon=True).start()
    log.info("worker metrics on http://%s:%d/metrics", f"[{host}]" if ":" in host else host, server.server_address[1])
    return server


class _ThreadingHTTPServerV6(ThreadingHTTPServer):
    address_family = socket.AF_INET6  # an IPv6 pod IP (IPv6-only or dual-stack clusters)
