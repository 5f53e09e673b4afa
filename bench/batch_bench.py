"""The Batch API backfilling idle capacity (issue 24): interactive Poisson load with and without a batch.

One engine on the demo model, the gateway and a Celery worker on the `batches` queue (as `make up` runs them).
Phase 1: tenant I sends streamed chat requests with Poisson arrivals for PHASE_S seconds; its TTFT is
measured, and the engine's busy fraction from its registry heartbeat (busy_s / wall_s over the phase).
Phase 2: tenant B submits a batch of BATCH_LINES lines through the Batch API, and the same interactive load
(same seed) runs again beside it. The batch's output tokens per second over the phase, and over its whole run
when it finishes, are reported. The target: interactive TTFT p99 with the batch within 10% of without.

`MPLEX_BENCH_BATCH_LINES` (default 5000; e.g. 300 for a short run), `MPLEX_BENCH_BATCH_PHASE_S` (60),
`MPLEX_BENCH_BATCH_RATE` (interactive requests a second, 1.0).
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import Target, pct, table, write_results
from bench.gateway_bench import _free_port, _seed_key, _wait, stop_procs

ROOT = Path(__file__).resolve().parents[1]
REDIS_DB = 11
BATCH_LINES = int(os.environ.get("MPLEX_BENCH_BATCH_LINES", "5000"))
PHASE_S = float(os.environ.get("MPLEX_BENCH_BATCH_PHASE_S", "60"))
RATE = float(os.environ.get("MPLEX_BENCH_BATCH_RATE", "1.0"))
INTERACTIVE_MAX_TOKENS = 32
BATCH_MAX_TOKENS = 64
QUESTIONS = ["What is the capital of France?", "What colour is the sky?", "Hello", "What is 2 plus 3?",
             "Name a fruit.", "What is the opposite of hot?", "Say something kind.", "What is the capital of Spain?"]


def _start(urls, settings, kit, logs: Path) -> tuple[list[subprocess.Popen], str, str]:
    import redis as sync_redis

    redis_url = f"{urls.redis_url.rsplit('/', 1)[0]}/{REDIS_DB}"
    sync_redis.Redis.from_url(redis_url).flushdb()
    env = {**os.environ, **urls.as_env(), "MPLEX_REDIS_URL": redis_url, "MPLEX_HOME": str(settings.home),
           "MPLEX_BASE_MODEL_DIR": str(kit.base_dir), "MPLEX_BASE_MODEL_NAME": kit.model_name, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    try:
        port, engine_id = _free_port(), f"batchbench-{os.getpid()}-{int(time.time())}"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "services.cli", "engine", "serve", "--model", str(kit.base_dir), "--served-model-name",
             kit.model_name, "--port", str(port), "--engine-id", engine_id, "--kv-memory-mb", "256", "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=open(logs / "engine.log", "wb"), stderr=subprocess.STDOUT))
        _wait(f"http://127.0.0.1:{port}/health", procs[-1])
        gw_port, worker_port = _free_port(), _free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "serve", "--port", str(gw_port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=open(logs / "gateway.log", "wb"), stderr=subprocess.STDOUT))
        _wait(f"http://127.0.0.1:{gw_port}/ready", procs[-1])
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "services.cli", "worker", "--queues", "batches", "--concurrency", "1",
             "--metrics-port", str(worker_port)],
            cwd=ROOT, env=env, stdout=open(logs / "worker.log", "wb"), stderr=subprocess.STDOUT))
        _wait(f"http://127.0.0.1:{worker_port}/ready", procs[-1])
    except BaseException:
        stop_procs(procs)
        raise
    return procs, f"http://127.0.0.1:{gw_port}", redis_url


def _busy(redis_url: str) -> tuple[float, float]:
    """(busy_s, wall_s) summed over the live engines' heartbeats."""
    import redis as sync_redis

    from services.common.engine_registry import read_snapshots_sync

    snaps = read_snapshots_sync(sync_redis.Redis.from_url(redis_url))
    return sum(s.busy_s or 0 for s in snaps), sum(s.wall_s or 0 for s in snaps)


async def _one(c: httpx.AsyncClient, key: str, model: str, question: str, delay: float) -> float | None:
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": INTERACTIVE_MAX_TOKENS,
            "stream": True, "temperature": 0}
    async with c.stream("POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        ttft = None
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content"' in line:
                ttft = time.perf_counter() - t0
        return ttft


async def interactive(base: str, key: str, model: str) -> dict:
    rng = random.Random(7)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(RATE)
        if t > PHASE_S:
            break
        arrivals.append((t, rng.choice(QUESTIONS)))
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        ttfts = await asyncio.gather(*(_one(c, key, model, q, at) for at, q in arrivals))
    ok = [x for x in ttfts if x is not None]
    return {"requests": len(arrivals), "failed": len(arrivals) - len(ok), "ttft_p50_s": pct(ok, 50), "ttft_p90_s": pct(ok, 90),
            "ttft_p99_s": pct(ok, 99)}


async def _warm(base: str, key: str, model: str) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        for q in QUESTIONS:
            await _one(c, key, model, q, 0.0)


def _phase(base: str, key: str, model: str, redis_url: str) -> dict:
    b0, w0 = _busy(redis_url)
    out = asyncio.run(interactive(base, key, model))
    time.sleep(6)  # one more heartbeat (every 5 s) covers the tail of the phase
    b1, w1 = _busy(redis_url)
    out["busy_fraction"] = (b1 - b0) / (w1 - w0) if w1 > w0 else float("nan")
    return out


def _submit(client, model: str) -> str:
    lines = [{"custom_id": f"bench-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
                       "max_tokens": BATCH_MAX_TOKENS, "temperature": 0.7, "seed": i}} for i in range(BATCH_LINES)]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    f = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


def run(base: str, kit, key_i: str, key_b: str, redis_url: str) -> dict:
    import openai

    # Warm-up, not counted: the first requests after start-up pay one-off costs (connections, key cache, the
    # engine's first steps) -- one such request was the "alone" p99 (~140 ms against a 16 ms median).
    asyncio.run(_warm(base, key_i, kit.model_name))
    alone = _phase(base, key_i, kit.model_name, redis_url)
    print(f"  interactive alone: {alone}", flush=True)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key_b, max_retries=2)
    t_submit = time.time()
    batch_id = _submit(client, kit.model_name)
    while client.batches.retrieve(batch_id).status == "validating":
        time.sleep(0.2)
    start = client.batches.retrieve(batch_id)
    with_batch = _phase(base, key_i, kit.model_name, redis_url)
    end = client.batches.retrieve(batch_id)
    phase_s = PHASE_S + 6
    with_batch["batch_tok_s"] = (end.usage.output_tokens - start.usage.output_tokens) / phase_s
    with_batch["batch_lines_per_s"] = (end.request_counts.completed - start.request_counts.completed) / phase_s
    print(f"  interactive with the batch: {with_batch}", flush=True)
    b0, w0 = _busy(redis_url)
    t0 = time.time()
    while (b := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(1)
    b1, w1 = _busy(redis_url)
    whole = {"lines": BATCH_LINES, "status": b.status, "completed": b.request_counts.completed, "failed": b.request_counts.failed,
             "wall_s": time.time() - t_submit, "output_tokens": b.usage.output_tokens,
             "tok_s": b.usage.output_tokens / (time.time() - t_submit),
             "busy_fraction_alone": (b1 - b0) / (w1 - w0) if w1 - w0 > 1 else float("nan"),
             "drain_s": time.time() - t0}
    print(f"  the batch: {whole}", flush=True)
    return {"alone": alone, "with_batch": with_batch, "batch": whole}


def step_costs(kit, repeats: int = 15) -> list[dict]:
    """What the steps an interactive request meets cost, in-process on the demo model (one torch thread, the
    serving engine's setting here): its prompt's step alone and beside decode rows (what the lean-step rule
    removes), and a step of decode rows with a batch prompt of 128 tokens (the token cap) or 35 (about what
    `--batch-prompt-ms 2` leaves on this kind of machine) -- the step an arriving request waits out
    (docs/engine.md, "Batch work yields to interactive first tokens"). All rows are interactive here, so that
    the scheduler's own batch rules do not reshape the steps being measured. Medians of `repeats` steps."""
    import statistics

    import torch

    from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from services.engine.engine import LLMEngine
    from services.engine.sequence import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(EngineConfig(model_dir=kit.base_dir, served_model_name=kit.model_name,
                                        cache=CacheConfig(memory_bytes=256 * 2**20),
                                        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)))
        rng = random.Random(0)
        vocab = engine.model.config.vocab_size
        n = 0

        def ids(k: int) -> list[int]:
            return [rng.randrange(4, vocab) for _ in range(k)]

        def add(prompt_len: int, max_tokens: int) -> None:
            nonlocal n
            n += 1
            engine.add_request(f"s{n}", ids(prompt_len), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

        def timed() -> float:
            t = time.perf_counter()
            engine.step()
            return 1000 * (time.perf_counter() - t)

        add(40, 4)  # warm-up
        while engine.has_unfinished():
            engine.step()
        rows = []
        for decodes in (0, 8, 16):
            for _ in range(decodes):
                add(40, 400)
            engine.step()  # their prompts
            decode_only, prompt45, prompt128, prompt35 = [], [], [], []
            for _ in range(repeats):
                if decodes:
                    decode_only.append(timed())
                for size, out in ((45, prompt45), (128, prompt128), (35, prompt35)):
                    add(size, 1)
                    out.append(timed())  # the prompt's step (its one token comes out of it)
            rows.append({"decode_rows": decodes,
                         "decodes_only_ms": statistics.median(decode_only) if decode_only else None,
                         "with_45_token_prompt_ms": statistics.median(prompt45),
                         "with_128_token_prompt_ms": statistics.median(prompt128),
                         "with_35_token_prompt_ms": statistics.median(prompt35)})
            for seq in list(engine.scheduler.running):
                engine.abort_request(seq.request_id)
            while engine.has_unfinished():
                engine.step()
        return rows
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    from services.common.embedded import embedded_services
    from services.common.migrate import upgrade
    from services.common.settings import Settings
    from services.modelkit import ensure_demo

    kit = ensure_demo()
    steps = step_costs(kit)
    print(table("what a step costs an interactive request (in-process, demo model, one thread; ms, median)",
                ["decode rows", "decodes only", "+ 45-token prompt", "+ 128-token prompt", "+ 35-token prompt"],
                [[r["decode_rows"], r["decodes_only_ms"] or 0.0, r["with_45_token_prompt_ms"], r["with_128_token_prompt_ms"],
                  r["with_35_token_prompt_ms"]] for r in steps]))
    settings = Settings()
    logs = Path(tempfile.mkdtemp(prefix="batchbench-"))
    with embedded_services(settings) as urls:
        upgrade(urls.database_url)
        key_i, key_b = _seed_key(urls.database_url), _seed_key(urls.database_url)
        procs, base, redis_url = _start(urls, settings, kit, logs)
        try:
            figures = run(base, kit, key_i, key_b, redis_url)
        finally:
            stop_procs(procs)
    alone, mixed, whole = figures["alone"], figures["with_batch"], figures["batch"]
    print(table(f"interactive Poisson load ({RATE:g}/s for {PHASE_S:g} s, {INTERACTIVE_MAX_TOKENS} tokens) with and "
                f"without a {BATCH_LINES}-line batch (TTFT ms)",
                ["run", "requests", "failed", "TTFT p50", "p90", "p99", "engine busy", "batch tok/s", "batch lines/s"],
                [["interactive alone", alone["requests"], alone["failed"], 1000 * alone["ttft_p50_s"], 1000 * alone["ttft_p90_s"],
                  1000 * alone["ttft_p99_s"], alone["busy_fraction"], 0.0, 0.0],
                 ["with the batch", mixed["requests"], mixed["failed"], 1000 * mixed["ttft_p50_s"], 1000 * mixed["ttft_p90_s"],
                  1000 * mixed["ttft_p99_s"], mixed["busy_fraction"], mixed["batch_tok_s"], mixed["batch_lines_per_s"]]]))
    print(table("the batch over its whole run", ["lines", "status", "completed", "failed", "wall s", "output tokens", "tok/s",
                                                  "busy (batch alone)"],
                [[whole["lines"], whole["status"], whole["completed"], whole["failed"], whole["wall_s"], whole["output_tokens"],
                  whole["tok_s"], whole["busy_fraction_alone"]]]))
    targets = [
        Target("interactive TTFT p99 with the batch / without (<= 1.10)", mixed["ttft_p99_s"] / alone["ttft_p99_s"], 1.10,
               higher_is_better=False),
        Target("interactive requests failed with the batch (= 0)", mixed["failed"], 0, higher_is_better=False),
        Target("batch finished: lines answered / lines (= 1)", (whole["completed"] + whole["failed"]) / whole["lines"], 1.0),
        Target("engine busy fraction with the batch - without (> 0: idle capacity used)",
               mixed["busy_fraction"] - alone["busy_fraction"], 0.0),
    ]
    write_results("batch", {"config": {"lines": BATCH_LINES, "phase_s": PHASE_S, "rate": RATE}, "step_costs": steps, **figures},
                  targets)


if __name__ == "__main__":
    main()
