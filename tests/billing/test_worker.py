"""The shared Celery app with a REAL worker process (and beat): billing tasks run, metrics and probes answer."""
from __future__ import annotations

import time
import uuid
from datetime import date, datetime, timezone

import httpx
import orjson
import pytest
from sqlalchemy import select

from services.common.models import EngineUsageReport, UsageDaily
from services.common.engine_registry import REGISTRY_SET, entry_key
from tests.billing.conftest import make_price
from tests.factories import make_tenant, make_usage_event, unique
from tests.stack import Stack, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(stack_env, tmp_path_factory):
    s = Stack(stack_env, tmp_path_factory.mktemp("billing-worker"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def worker(stack):
    return stack.worker("billing")


@pytest.fixture
def celery(settings):
    from services.common.celery_app import app

    return app


def wait_for(fn, timeout: float = 60.0, what: str = "condition", proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}" + (f"; {proc.name} log:\n{proc.tail()}" if proc else ""))


def metric_value(text: str, name: str, labels: dict[str, str]) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_worker_runs_a_rollup_task_and_counts_it(worker, celery, db):
    plan = unique("plan")
    make_price(db, plan=plan)
    tenant = make_tenant(db, plan=plan)
    day = date(2024, 6, 1)
    make_usage_event(db, tenant=tenant, prompt_tokens=10_000, completion_tokens=0,
                     created_at=datetime(2024, 6, 1, 12, tzinfo=timezone.utc))
    db.commit()

    celery.send_task("billing.rollup", kwargs={"days": [day.isoformat()]})

    def landed():
        db.rollback()
        return db.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant.id)).all()

    (row,) = wait_for(landed, what="the worker's roll-up", proc=worker)
    assert (row.day, row.requests, row.amount_micros) == (day, 1, 2000)

    body = httpx.get(f"{worker.url}/metrics", timeout=5).text
    assert metric_value(body, "mplex_worker_tasks_total", {"task": "billing.rollup", "state": "success"}) >= 1
    assert metric_value(body, "mplex_worker_tasks_total", {"task": "billing.rollup", "state": "started"}) >= 1
    assert metric_value(body, "mplex_worker_task_duration_seconds_count", {"task": "billing.rollup"}) >= 1
    assert metric_value(body, "mplex_worker_queue_depth", {"queue": "billing"}) == 0


def test_queue_depth_reads_the_broker(worker, celery):
    """Messages for a queue this worker does not consume wait in the broker and show in the gauge."""
    queue = "adapters.eval"
    with celery.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue) if _declared(conn, queue) else None
    for _ in range(3):
        celery.send_task("adapters.eval.not_consumed_here", queue=queue)
    try:
        body = httpx.get(f"{worker.url}/metrics", timeout=5).text
        assert metric_value(body, "mplex_worker_queue_depth", {"queue": queue}) == 3
    finally:
        with celery.connection_for_write() as conn:
            conn.default_channel.queue_purge(queue)
    body = httpx.get(f"{worker.url}/metrics", timeout=5).text
    assert metric_value(body, "mplex_worker_queue_depth", {"queue": queue}) == 0


def _declared(conn, queue: str) -> bool:
    from kombu.exceptions import ChannelError

    try:
        conn.default_channel.queue_declare(queue=queue, passive=True)
        return True
    except ChannelError:
        return False


def test_probes(worker):
    assert httpx.get(f"{worker.url}/health", timeout=5).json() == {"status": "ok"}
    ready = httpx.get(f"{worker.url}/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["checks"] == {"consuming": True, "broker": True, "database": True}
    assert httpx.get(f"{worker.url}/nope", timeout=5).status_code == 404


def test_failing_task_is_counted_as_failure(worker, celery):
    # A bad argument is a bug, not an outage: no retries, one failure.
    celery.send_task("billing.rollup", kwargs={"days": ["not-a-day"]})

    def failed():
        body = httpx.get(f"{worker.url}/metrics", timeout=5).text
        return (metric_value(body, "mplex_worker_tasks_total", {"task": "billing.rollup", "state": "failure"}) or 0) >= 1

    wait_for(failed, what="a failure count", proc=worker)


def test_task_defaults(celery):
    import services.billing.tasks  # noqa: F401 (registers the tasks, as the worker does from conf.include)

    conf = celery.conf
    assert "services.billing.tasks" in conf.include
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"
    assert {q.name for q in conf.task_queues} == {"adapters.ingest", "adapters.eval", "billing", "batches"}
    task = celery.tasks["billing.rollup"]
    assert task.max_retries == 5 and task.retry_backoff and task.autoretry_for
    assert celery.amqp.router.route({}, "billing.rollup")["queue"].name == "billing"


def test_beat_drives_the_engine_sampler(stack, worker, redis_client, db):
    """beat -> broker -> worker -> registry sample -> engine_usage_reports, all real processes."""
    engine_id = unique("beat-engine")
    started = time.time() - 30
    snap = {"id": engine_id, "url": "http://127.0.0.1:1", "base_model": "mplex-demo", "engine_type": "cpu",
            "started_at": started, "wall_s": 30.0, "busy_s": 12.5, "ts": time.time()}
    redis_client.set(entry_key(engine_id), orjson.dumps(snap), ex=120)
    redis_client.sadd(REGISTRY_SET, engine_id)
    try:
        beat = stack._spawn("beat", ["beat", "--schedule", str(stack.log_dir / f"beat-{uuid.uuid4().hex}")])

        def reported():
            db.rollback()
            return db.scalars(select(EngineUsageReport).where(EngineUsageReport.engine_id == engine_id)).all()

        (window,) = wait_for(reported, timeout=90, what="a beat-driven engine sample", proc=beat)
        assert (window.busy_us, window.idle_us) == (12_500_000, 17_500_000)
        assert window.engine_type == "cpu"
    finally:
        redis_client.delete(entry_key(engine_id))
        redis_client.srem(REGISTRY_SET, engine_id)


def listening_addresses(pid: int, port: int) -> set[str]:
    import psutil

    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_worker_metrics_port_listens_on_loopback_only_by_default(worker):
    port = int(worker.url.rsplit(":", 1)[1])
    assert listening_addresses(worker.popen.pid, port) == {"127.0.0.1"}


def test_worker_metrics_address_is_configurable(stack):
    # Kubernetes passes the pod IP the same way; another loopback address stands in for it here.
    port = free_port()
    proc = stack._spawn("worker-env-port", ["worker", "--queues", "adapters.ingest"],
                        env={"MPLEX_WORKER_METRICS_PORT": str(port), "MPLEX_WORKER_METRICS_HOST": "127.0.0.2"},
                        ready=f"http://127.0.0.2:{port}/ready")
    try:
        assert httpx.get(f"http://127.0.0.2:{port}/health", timeout=5).status_code == 200
        assert listening_addresses(proc.popen.pid, port) == {"127.0.0.2"}
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        stack.stop(proc)


def test_not_ready_without_its_database(stack):
    port, dead = free_port(), free_port()  # nothing listens on `dead`
    proc = stack._spawn("worker-no-db", ["worker", "--queues", "adapters.ingest", "--metrics-port", str(port)],
                        env={"MPLEX_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{dead}/mplex"})
    try:
        def answered():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
            except httpx.HTTPError:
                return None

        def consuming():
            r = answered()
            return r if r is not None and r.json()["checks"]["consuming"] else None

        r = wait_for(consuming, what="the worker to start consuming", proc=proc)
        assert r.status_code == 503 and r.json()["checks"] == {"consuming": True, "broker": True, "database": False}
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200  # alive, just not ready
    finally:
        stack.stop(proc)
