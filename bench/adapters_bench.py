"""Adapter lifecycle figures on the demo kit: ingest time (upload -> ready through the real pipeline) and
adapter cold-load time into the engine.

Ingest: a scratch database on the embedded Postgres (or MPLEX_DATABASE_URL's server), Redis databases of its
own (so a running `make up` does not take the work), a real Celery worker subprocess (`mplex worker`, 2
processes), a scratch object store. Each demo adapter is uploaded with its eval set by the CLI's upload
function (the HTTP API calls the same one) and timed until its version is `ready`: one at a time for
MPLEX_BENCH_ADAPTER_ROUNDS rounds (the first round includes each worker process building its gate engines),
then all four at once. Per version: validation (upload -> evaluating) and the gate run (FP8 + full
precision, 40 examples, latency sample) from the run's own timestamps.

Cold load: the engine library in this process (FP8 base, CPU). An adapter not resident anywhere is loaded
from the object store — fetch + validate + convert into the host tier (`load_sync`), and as a request sees
it: time to first token with the adapter cold vs already in a device slot. From a local store (file://) and
from a remote-like one (fsspec memory://: the engine copies it into its cache first).

Targets (CPU, 2 cores): ingest p50 <= 5 s per demo adapter; cold load p99 <= 0.25 s.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import Target, pct, table, write_results

ROUNDS = int(os.environ.get("MPLEX_BENCH_ADAPTER_ROUNDS", "3"))
LOADS = int(os.environ.get("MPLEX_BENCH_ADAPTER_LOADS", "20"))  # cold loads per adapter and store
INGEST_TARGET_S = 5.0
COLD_LOAD_TARGET_S = 0.25
ROOT = Path(__file__).resolve().parents[1]
# Redis database indexes of their own on the shared server (0/1 are the dev stack's and tests' defaults).
REDIS_DB, BROKER_DB = 12, 13


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_db(redis_url: str, db: int) -> str:
    from urllib.parse import urlsplit, urlunsplit

    return urlunsplit(urlsplit(redis_url)._replace(path=f"/{db}"))


def _database(server_url: str):
    """A fresh database on the server; returns (url, drop())."""
    from sqlalchemy import make_url, text

    from services.common.db import make_db_engine

    server = make_url(server_url)
    admin = make_db_engine(server.set(database="postgres").render_as_string(hide_password=False), pool_size=1, max_overflow=0,
                        isolation_level="AUTOCOMMIT")
    name = f"mplex_bench_adapters_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return server.set(database=name).render_as_string(hide_password=False), drop


def _start_worker(env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    popen = subprocess.Popen([sys.executable, "-m", "services.cli", "worker", "--queues", "adapters.ingest,adapters.eval",
                              "--concurrency", "2", "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
                             cwd=ROOT, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, stdout=open(log, "wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"the worker exited ({popen.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return popen, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    _stop(popen)
    raise RuntimeError(f"the worker was not ready in 120 s; see {log}")


def _stop(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


# -- ingest --------------------------------------------------------------------------------------------------------
def measure_ingest(kit, home: Path, db_url: str, redis_url: str, broker_url: str) -> dict:
    from sqlalchemy import select

    from services.adapters.cli import upload_path
    from services.adapters.tasks import enqueue_ingest
    from services.adapters.upload import private_dir
    from services.common.db import make_db_engine, make_sessionmaker
    from services.common.models import AdapterStatus, AdapterVersion, EvalRun, Tenant
    from services.common.settings import Settings

    settings = Settings(home=home, database_url=db_url, redis_url=redis_url, broker_url=broker_url,
                        base_model_dir=Path(kit.base_dir), base_model_name=kit.model_name)
    engine = make_db_engine(db_url, pool_size=2, max_overflow=0)
    factory = make_sessionmaker(engine)
    with factory() as s:
        tenant = Tenant(name="Bench adapters", slug=f"bench-adapters-{uuid.uuid4().hex[:6]}")
        s.add(tenant)
        s.commit()
        slug = tenant.slug

    def upload(name: str, demo) -> uuid.UUID:
        with private_dir(home / "sandbox", "bench-") as staging:
            result = upload_path(Path(demo.path), tenant=slug, name=name, eval_set=Path(demo.eval_path).read_bytes(),
                                 staging=staging, settings=settings, session_factory=factory)
        assert enqueue_ingest(result.version_id), "the broker refused the ingest message"
        return result.version_id

    def wait(ids: list[uuid.UUID], timeout: float = 600) -> dict[uuid.UUID, float]:
        """Seconds from now until each version is decided (polled every 20 ms)."""
        t0, done = time.perf_counter(), {}
        while len(done) < len(ids):
            with factory() as s:
                for vid, status in s.execute(select(AdapterVersion.id, AdapterVersion.status)
                                             .where(AdapterVersion.id.in_(ids))).all():
                    if vid not in done and AdapterStatus(status).is_final:
                        done[vid] = time.perf_counter() - t0
                        if str(status) != "ready":
                            raise RuntimeError(f"version {vid} was {status}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"versions not decided in {timeout}s")
            time.sleep(0.02)
        return done

    def phases(vid: uuid.UUID) -> tuple[float, float]:
        """(validation: created -> gate started, gate run seconds) from the version's and run's timestamps."""
        with factory() as s:
            v = s.get(AdapterVersion, vid)
            run = s.scalars(select(EvalRun).where(EvalRun.adapter_version_id == vid)).one()
            return (run.started_at - v.created_at).total_seconds(), (run.finished_at - run.started_at).total_seconds()

    rows, samples, first_round = [], [], []
    for r in range(ROUNDS):
        for name, demo in sorted(kit.adapters.items()):
            t0 = time.perf_counter()
            vid = upload(f"{name}-r{r}", demo)
            uploaded = time.perf_counter() - t0
            total = uploaded + wait([vid])[vid]
            validate_s, gate_s = phases(vid)
            (first_round if r == 0 else samples).append(total)
            rows.append([r, name, uploaded, validate_s, gate_s, total])
            print(f"  round {r} {name:<10} upload {uploaded:.3f}s  ready after {total:.3f}s", flush=True)
    # All four at once: two worker processes share them.
    t0 = time.perf_counter()
    ids = [upload(f"{name}-burst", demo) for name, demo in sorted(kit.adapters.items())]
    burst = time.perf_counter() - t0 + max(wait(ids).values())
    engine.dispose()
    steady = samples or first_round
    print(table("adapters: ingest (upload -> ready), one at a time", ["round", "adapter", "upload s", "validate s", "gate s", "total s"], rows))
    return {
        "ingest_seconds": {"p50": round(pct(steady, 50), 3), "p99": round(pct(steady, 99), 3), "max": round(max(steady), 3),
                           "n": len(steady), "first_round_mean": round(sum(first_round) / len(first_round), 3),
                           "note": "rounds after the first (each worker process builds its gate engines once)"},
        "ingest_burst_4_seconds": round(burst, 3),
        "ingest_rows": [dict(zip(("round", "adapter", "upload_s", "validate_s", "gate_s", "total_s"),
                                 [x if not isinstance(x, float) else round(x, 4) for x in row])) for row in rows],
    }


# -- cold load -----------------------------------------------------------------------------------------------------
def measure_cold_loads(kit, store_root: Path) -> dict:
    import torch

    from services.adapters.storage import ObjectStore
    from services.common.prompting import PromptBuilder
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig
    from services.engine.engine import LLMEngine
    from services.engine.sequence import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model_dir=Path(kit.base_dir), served_model_name=kit.model_name, weight_dtype="fp8",
                                    engine_id="bench-adapters", adapter_cache_dir=store_root / "engine-cache",
                                    cache=CacheConfig(memory_bytes=64 << 20, enable_prefix_caching=False),
                                    lora=LoraConfig(max_loras=4, max_cpu_loras=4)))
    (store_root / "engine-cache").mkdir(parents=True, exist_ok=True)
    prompt = PromptBuilder(Path(kit.base_dir)).chat_ids([{"role": "user", "content": "Reverse the words: one two three"}])
    stores = {"file": ObjectStore(f"file://{store_root / 'objects'}"), "remote": ObjectStore(f"memory://mplex-bench-{uuid.uuid4().hex[:6]}")}
    refs = {kind: {name: _ref(store.put_version(Path(d.path)), name) for name, d in kit.adapters.items()}
            for kind, store in stores.items()}
    sizes = {name: sum(p.stat().st_size for p in Path(d.path).iterdir()) for name, d in kit.adapters.items()}

    def first_token(ref) -> float:
        t0 = time.perf_counter()
        rid = f"bench-{uuid.uuid4().hex[:8]}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), adapter=ref)
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
            if engine.last_plan_empty and engine.has_unfinished():
                engine.wake.wait(0.001)
                engine.wake.clear()
        return time.perf_counter() - t0

    def make_cold(kind: str, ref) -> None:
        engine.adapters.poll()
        engine.adapters.unload(ref.content_id)
        if kind == "remote":
            shutil.rmtree(store_root / "engine-cache" / ref.content_id, ignore_errors=True)

    first_token(None)  # warm the base path
    loads: dict[str, list[float]] = {"file": [], "remote": []}
    ttft_cold: list[float] = []
    ttft_warm: list[float] = []
    rows = []
    for kind in ("file", "remote"):
        for name, ref in sorted(refs[kind].items()):
            per = []
            for _ in range(LOADS):
                make_cold(kind, ref)
                t0 = time.perf_counter()
                engine.adapters.load_sync(ref)
                per.append(time.perf_counter() - t0)
            loads[kind] += per
            if kind == "file":
                for _ in range(max(3, LOADS // 4)):
                    make_cold(kind, ref)
                    ttft_cold.append(first_token(ref))
                    ttft_warm.append(first_token(ref))  # now in a device slot
            rows.append([kind, name, sizes[name] / 1e6, pct(per, 50), pct(per, 99)])
    engine.adapters.shutdown()
    print(table("adapters: cold load into the engine (fetch + validate + convert)", ["store", "adapter", "MB", "p50 s", "p99 s"], rows))
    print(table("adapters: time to first token", ["adapter state", "p50 s", "p99 s"],
                [["cold (loaded on demand)", pct(ttft_cold, 50), pct(ttft_cold, 99)],
                 ["in a device slot", pct(ttft_warm, 50), pct(ttft_warm, 99)]]))
    summary = {kind: {"p50": round(pct(v, 50), 4), "p99": round(pct(v, 99), 4), "n": len(v)} for kind, v in loads.items()}
    return {
        "cold_load_seconds": summary,
        "ttft_seconds": {"cold": {"p50": round(pct(ttft_cold, 50), 4), "p99": round(pct(ttft_cold, 99), 4)},
                         "slot_resident": {"p50": round(pct(ttft_warm, 50), 4), "p99": round(pct(ttft_warm, 99), 4)},
                         "n": len(ttft_cold)},
        "adapter_bytes": sizes,
    }


def _ref(stored, name: str):
    from services.engine.sequence import AdapterRef

    return AdapterRef(stored.sha256, name, stored.uri)


def main() -> None:
    from services.common.db import reset_db_engine
    from services.common.embedded import embedded_services
    from services.common.migrate import upgrade
    from services.common.settings import Settings, get_settings
    from services.modelkit import ensure_demo

    kit = ensure_demo(Settings().home, progress=True)
    with embedded_services(Settings()) as urls, tempfile.TemporaryDirectory(prefix="mplex-bench-adapters-") as tmp:
        home = Path(tmp)
        db_url, drop = _database(urls.database_url)
        redis_url, broker_url = _with_db(urls.redis_url, REDIS_DB), _with_db(urls.redis_url, BROKER_DB)
        env = {"MPLEX_HOME": str(home), "MPLEX_DATABASE_URL": db_url, "MPLEX_REDIS_URL": redis_url,
               "MPLEX_BROKER_URL": broker_url, "MPLEX_BASE_MODEL_DIR": str(kit.base_dir),
               "MPLEX_BASE_MODEL_NAME": kit.model_name}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # this process's Celery client and settings use the scratch services
        get_settings.cache_clear()
        reset_db_engine()
        worker = None
        try:
            import redis

            redis.Redis.from_url(broker_url).flushdb()  # a previous interrupted run's messages
            upgrade(db_url)
            worker, _ = _start_worker(env, home / "worker.log")
            ingest = measure_ingest(kit, home, db_url, redis_url, broker_url)
        except Exception:
            log = home / "worker.log"
            if log.exists():
                print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            if worker is not None:
                _stop(worker)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            get_settings.cache_clear()
            reset_db_engine()
            drop()
        cold = measure_cold_loads(kit, home / "cold")
    write_results("adapters", {"demo_adapters": sorted(kit.adapters), "rounds": ROUNDS, **ingest, **cold}, [
        Target("ingest p50 seconds (upload -> ready)", ingest["ingest_seconds"]["p50"], INGEST_TARGET_S, higher_is_better=False),
        Target("cold load p99 seconds (file store)", cold["cold_load_seconds"]["file"]["p99"], COLD_LOAD_TARGET_S,
               higher_is_better=False),
        Target("cold load p99 seconds (remote store)", cold["cold_load_seconds"]["remote"]["p99"], COLD_LOAD_TARGET_S,
               higher_is_better=False),
    ])


if __name__ == "__main__":
    main()
