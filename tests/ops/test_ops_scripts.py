"""The scripts baked into the images: the HEALTHCHECK probe and the engine's preStop drain, run against real
HTTP servers that expose real prometheus_client registries."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from ops_support import DOCKER, load_file_module
from prometheus_client import CollectorRegistry, Gauge, generate_latest

drain_mod = load_file_module(DOCKER / "engine_drain.py")
health_mod = load_file_module(DOCKER / "healthcheck.py")


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


@contextmanager
def serve(app) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, server_class=WSGIServer, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def engine_registry() -> tuple[CollectorRegistry, Gauge, Gauge]:
    registry = CollectorRegistry()
    running = Gauge("mplex_engine_requests_running", "Sequences in the running batch", ["model"], registry=registry)
    waiting = Gauge("mplex_engine_requests_waiting", "Sequences waiting for admission", ["model"], registry=registry)
    Gauge("mplex_engine_requests_running_peak", "A look-alike that must not be counted", registry=registry).set(50)
    return registry, running, waiting


def engine_app(registry: CollectorRegistry, drain_status: str, calls: list[str]):
    def app(environ, start_response):
        calls.append(f'{environ["REQUEST_METHOD"]} {environ["PATH_INFO"]}')
        if environ["PATH_INFO"] == "/metrics":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [generate_latest(registry)]
        if environ["PATH_INFO"] == "/drain" and environ["REQUEST_METHOD"] == "POST":
            start_response(drain_status, [("Content-Type", "application/json")])
            return [b"{}"]
        start_response("404 Not Found", [])
        return [b""]

    return app


def test_in_flight_sums_running_and_waiting_over_label_sets():
    registry, running, waiting = engine_registry()
    running.labels(model="base").set(3)
    running.labels(model="other").set(1)
    waiting.labels(model="base").set(2)
    assert drain_mod.in_flight(generate_latest(registry).decode()) == 6
    assert drain_mod.in_flight("# HELP x\nprocess_cpu_seconds_total 3.0\n") is None


def test_drain_waits_until_in_flight_work_has_finished():
    registry, running, waiting = engine_registry()
    state = {"running": 2, "waiting": 1}

    def publish() -> None:
        running.labels(model="base").set(state["running"])
        waiting.labels(model="base").set(state["waiting"])

    def finish_one_per_poll(_seconds: float) -> None:
        # Each poll interval one step of progress: the waiting request is admitted, then both running ones end.
        if state["waiting"]:
            state["waiting"] -= 1
        elif state["running"]:
            state["running"] -= 1
        publish()

    publish()
    calls: list[str] = []
    with serve(engine_app(registry, "202 Accepted", calls)) as url:
        result = drain_mod.drain(url, timeout_s=3600, poll_interval_s=0.01, sleep=finish_one_per_poll)
    assert result.drain_acknowledged and result.idle and result.last_in_flight == 0
    assert calls[0] == "POST /drain"
    # Reads 3, 2, 1, 0, 0: two consecutive idle reads end the wait.
    assert result.polls == 5


def test_drain_gives_up_at_the_deadline_and_tolerates_an_engine_without_drain():
    registry, running, _ = engine_registry()
    running.labels(model="base").set(4)
    now = [0.0]

    def advance(seconds: float) -> None:
        now[0] += seconds

    calls: list[str] = []
    with serve(engine_app(registry, "404 Not Found", calls)) as url:
        result = drain_mod.drain(url, timeout_s=10, poll_interval_s=1, clock=lambda: now[0], sleep=advance)
    assert not result.drain_acknowledged and not result.idle
    assert result.last_in_flight == 4 and result.polls == 11


def test_drain_sends_the_engine_credential_on_both_calls():
    registry, running, waiting = engine_registry()
    running.labels(model="base").set(0)
    waiting.labels(model="base").set(0)
    seen: list[str | None] = []

    def app(environ, start_response):
        seen.append(environ.get("HTTP_AUTHORIZATION"))
        return engine_app(registry, "202 Accepted", [])(environ, start_response)

    with serve(app) as url:
        result = drain_mod.drain(url, timeout_s=5, poll_interval_s=0, headers={"Authorization": "Bearer engine-token"})
    assert result.idle and seen and set(seen) == {"Bearer engine-token"}


def test_drain_main_never_fails_the_hook_when_the_engine_is_gone():
    with serve(lambda env, start: (start("200 OK", []), [b""])[1]) as url:
        port = int(url.rsplit(":", 1)[1])
    # The server is closed now: nothing listens on that port.
    assert drain_mod.main(["--port", str(port), "--timeout", "0", "--poll-interval", "0"]) == 0
    assert drain_mod.drain(f"http://127.0.0.1:{port}", 0, 0).last_in_flight is None


@pytest.mark.parametrize(("status", "healthy"), [("200 OK", True), ("503 Service Unavailable", False)])
def test_healthcheck_follows_the_health_endpoint(status, healthy, monkeypatch):
    def app(environ, start_response):
        start_response(status if environ["PATH_INFO"] == "/health" else "404 Not Found", [])
        return [b"ok"]

    with serve(app) as url:
        assert health_mod.is_healthy(f"{url}/health") is healthy
        monkeypatch.setenv("MPLEX_HEALTH_URL", f"{url}/health")
        assert health_mod.main() == (0 if healthy else 1)
    assert health_mod.is_healthy(f"{url}/health") is False  # nothing listening any more
