"""A stub engine for gateway-overhead benchmarks: answers instantly on both the internal NDJSON stream
(what our gateway calls) and the OpenAI API (what LiteLLM and direct clients call), and heartbeats
into the registry like a real engine. Benchmark plumbing only; never used by tests."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import orjson
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

TOKENS = 8


def build(model: str, redis_url: str | None, url: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = None
        if redis_url:
            client = aioredis.from_url(redis_url)

            async def beat():
                while True:
                    snap = {"id": "stub-engine", "url": url, "base_model": model, "running": 0, "waiting": 0,
                            "kv_usage": 0.0, "max_num_seqs": 1024, "max_model_len": 4096, "ts": time.time()}
                    await client.set("mplex:engine:stub-engine", orjson.dumps(snap), ex=5)
                    await client.sadd("mplex:engines", "stub-engine")
                    await client.expire("mplex:engines", 60)
                    await asyncio.sleep(1)

            task = asyncio.create_task(beat())
        yield
        if task:
            task.cancel()

    app = FastAPI(lifespan=lifespan)
    words = ["Hello", " there", ",", " how", " can", " I", " help", "?"]

    @app.get("/ready")
    async def ready():
        return {"ready": True}

    @app.post("/internal/v1/generate")
    async def generate(request: Request):
        body = orjson.loads(await request.body())
        lines = [orjson.dumps({"text": w, "token_ids": [i + 5], "logprobs": None, "finish_reason": None}) for i, w in enumerate(words[:-1])]
        lines.append(orjson.dumps({"text": words[-1], "token_ids": [99], "logprobs": None, "finish_reason": "stop",
                                   "usage": {"prompt_tokens": len(body["prompt_token_ids"]), "cached_tokens": 0,
                                             "completion_tokens": TOKENS, "compute_seconds": 0.0, "engine_id": "stub-engine"}}))
        payload = b"\n".join(lines) + b"\n"

        async def gen():
            yield payload

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.body()
        doc = {"id": "chatcmpl-stub", "object": "chat.completion", "created": int(time.time()), "model": model,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 12, "completion_tokens": TOKENS, "total_tokens": 12 + TOKENS}}
        return Response(orjson.dumps(doc), media_type="application/json")

    return app


if __name__ == "__main__":
    port, model = int(sys.argv[1]), sys.argv[2]
    redis_url = sys.argv[3] if len(sys.argv) > 3 else None
    uvicorn.run(build(model, redis_url, f"http://127.0.0.1:{port}"), host="127.0.0.1", port=port, log_level="warning")
