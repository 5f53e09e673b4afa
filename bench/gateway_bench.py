"""Gateway overhead: latency added by our gateway vs LiteLLM proxy, in front of the same instant stub.

Each system does its full request path: ours authenticates a key (Redis-cached), tokenizes the prompt,
reserves and settles quota in Redis (Lua), routes by the registry and writes the ledger row;
LiteLLM checks its master key, applies a Redis-backed TPM limit and tracks spend in a callback.
Added latency = system latency - direct-to-stub latency, p50/p99, at concurrency 1 and 32.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench.common import Target, pct, table, write_results

ROOT = Path(__file__).resolve().parents[1]
LITELLM = ROOT / ".venv-litellm" / "bin" / "litellm"
MODEL = "stub-model"
REQUESTS = {1: 1000, 32: 4000}
ROUNDS = 5
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to the benchmark, please."}], "max_tokens": 8}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 120, headers: dict | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} process exited ({proc.returncode})")
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready")


async def _load(url: str, headers: dict, concurrency: int, n: int) -> list[float]:
    lat: list[float] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency * 2)) as c:
        for _ in range(10):  # warm-up (connections, caches)
            (await c.post(url, json=BODY, headers=headers)).raise_for_status()
        queue = list(range(n))

        async def worker():
            while queue:
                queue.pop()
                t0 = time.perf_counter()
                r = await c.post(url, json=BODY, headers=headers)
                lat.append(time.perf_counter() - t0)
                r.raise_for_status()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


def stop_procs(procs: list[subprocess.Popen]) -> None:
    """Terminate the benchmark's processes, last started first; kill what does not exit in 20 s."""
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def _seed_key(database_url: str) -> str:
    from sqlalchemy.orm import Session

    from services.common.db import make_db_engine
    from services.common.keys import generate_key
    from services.common.models import ApiKey, Tenant, TenantLimits

    new = generate_key()
    with Session(make_db_engine(database_url)) as s:
        t = Tenant(name="bench", slug=f"bench-{uuid.uuid4().hex[:8]}", plan="default")
        s.add(t)
        s.flush()
        s.add(TenantLimits(tenant_id=t.id, tokens_per_min=10**9, requests_per_min=10**7, concurrent_requests=10**6))
        s.add(ApiKey(tenant_id=t.id, prefix=new.prefix, key_hash=new.hash, name="bench"))
        s.commit()
    return new.full


def main() -> None:
    from services.common.embedded import embedded_services
    from services.common.migrate import upgrade
    from services.common.settings import Settings
    from services.modelkit import ensure_demo

    kit = ensure_demo()
    settings = Settings()
    procs: list[subprocess.Popen] = []
    logs = Path(tempfile.mkdtemp(prefix="gwbench-"))
    with embedded_services(settings) as urls:
        redis_db = urls.redis_url.rsplit("/", 1)[0] + "/7"  # a registry of its own: only the stub serves here
        import redis as sync_redis

        sync_redis.Redis.from_url(redis_db).flushdb()
        upgrade(urls.database_url)
        key = _seed_key(urls.database_url)
        try:
            stub_port = _free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.stub_upstream", str(stub_port), MODEL, redis_db],
                                          cwd=ROOT, stdout=open(logs / "stub.log", "wb"), stderr=subprocess.STDOUT))
            _wait(f"http://127.0.0.1:{stub_port}/ready", procs[-1])
            gw_port = _free_port()
            env = {**os.environ, **urls.as_env(), "MPLEX_REDIS_URL": redis_db, "MPLEX_BASE_MODEL_NAME": MODEL,
                   "MPLEX_BASE_MODEL_DIR": str(kit.base_dir), "MPLEX_HOME": str(settings.home)}
            procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "serve", "--port", str(gw_port), "--log-level", "warning"],
                                          cwd=ROOT, env=env, stdout=open(logs / "gateway.log", "wb"), stderr=subprocess.STDOUT))
            _wait(f"http://127.0.0.1:{gw_port}/ready", procs[-1])
            systems = {
                "direct": (f"http://127.0.0.1:{stub_port}/v1/chat/completions", {}),
                "multiplex": (f"http://127.0.0.1:{gw_port}/v1/chat/completions", {"authorization": f"Bearer {key}"}),
            }
            litellm_note = "not installed"
            if LITELLM.exists():
                ll_port = _free_port()
                redis_host, redis_port = urls.redis_url.split("//")[1].split("/")[0].split(":")
                cfg = logs / "litellm.yaml"
                cfg.write_text(
                    "model_list:\n"
                    f"  - model_name: {MODEL}\n"
                    "    litellm_params:\n"
                    f"      model: openai/{MODEL}\n"
                    f"      api_base: http://127.0.0.1:{stub_port}/v1\n"
                    "      api_key: stub\n"
                    "      tpm: 1000000000\n"
                    "      rpm: 10000000\n"
                    "router_settings:\n"
                    f"  redis_host: {redis_host}\n"
                    f"  redis_port: {redis_port}\n"
                    "  enable_pre_call_checks: true\n"
                    "litellm_settings:\n"
                    "  success_callback: []\n"
                    "  drop_params: true\n"
                    "general_settings:\n"
                    "  master_key: sk-bench-master-key\n"
                )
                ll_env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
                procs.append(subprocess.Popen([str(LITELLM), "--config", str(cfg), "--port", str(ll_port), "--num_workers", "1"],
                                              cwd=logs, env=ll_env, stdout=open(logs / "litellm.log", "wb"), stderr=subprocess.STDOUT))
                _wait(f"http://127.0.0.1:{ll_port}/health/liveliness", procs[-1], timeout=240)
                systems["litellm"] = (f"http://127.0.0.1:{ll_port}/v1/chat/completions", {"authorization": "Bearer sk-bench-master-key"})
                litellm_note = ("master-key auth, Redis-backed TPM/RPM limits, cost tracking; its Postgres virtual keys "
                                "and spend-log tables need Prisma engine downloads, impossible offline")
            results: dict[str, dict] = {}
            for conc, n in REQUESTS.items():
                # Interleaved rounds, so a change in background load hits every system alike.
                lats: dict[str, list[float]] = {name: [] for name in systems}
                for _ in range(ROUNDS):
                    for name, (url, headers) in systems.items():
                        lats[name] += asyncio.run(_load(url, headers, conc, n // ROUNDS))
                for name, lat in lats.items():
                    results.setdefault(name, {})[f"c{conc}"] = {"p50_ms": 1000 * pct(lat, 50), "p99_ms": 1000 * pct(lat, 99), "n": len(lat)}
                    print(f"  {name} c={conc}: p50 {1000 * pct(lat, 50):.2f} ms  p99 {1000 * pct(lat, 99):.2f} ms", flush=True)
        finally:
            stop_procs(procs)
    rows, added = [], {}
    for name in results:
        if name == "direct":
            continue
        for conc in REQUESTS:
            d, s = results["direct"][f"c{conc}"], results[name][f"c{conc}"]
            add50, add99 = s["p50_ms"] - d["p50_ms"], s["p99_ms"] - d["p99_ms"]
            added[(name, conc)] = (add50, add99)
            rows.append([name, conc, s["p50_ms"], s["p99_ms"], add50, add99])
    print(table("added latency vs direct-to-stub (ms)", ["system", "concurrency", "p50", "p99", "added p50", "added p99"], rows))
    targets = []
    figures = {"results_ms": results, "added_ms": {f"{k[0]}_c{k[1]}": {"p50": v[0], "p99": v[1]} for k, v in added.items()},
               "litellm_config": litellm_note}
    if ("litellm", 1) in added:
        for conc in REQUESTS:
            ours, theirs = added[("multiplex", conc)][0], added[("litellm", conc)][0]
            targets.append(Target(f"added p50 ours / LiteLLM at c={conc} (<= 0.2)", ours / theirs if theirs > 0 else float("nan"), 0.2, higher_is_better=False))
    write_results("gateway", figures, targets)
