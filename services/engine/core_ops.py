"""The named operations a front-end may run on the engine core (adapters, registry snapshot, metrics).

By name, not by closure, so they cross a process boundary: the in-process `AsyncEngine` and the core
process run the same functions on the thread that owns the engine's state. Arguments and results are
plain values (msgspec-encodable).
"""
from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client import generate_latest

from services.engine.core_protocol import EngineInfo
from services.engine.engine import LLMEngine
from services.engine.registry import Uptime, snapshot, unload_retired
from services.engine.sequence import AdapterRef


def adapter_state(engine: LLMEngine) -> dict[str, Any]:
    a = engine.adapters
    return {"host": [w.content_id for w in (a.resident() if a else [])], "slots": a.slot_owners() if a else []}


def unload_adapter(engine: LLMEngine, content_id: str) -> bool:
    return engine.adapters.unload(content_id)


def load_adapter(engine: LLMEngine, content_id: str, name: str, path: str) -> dict[str, Any]:
    """Validate and host-cache an adapter. Blocking file work: the core runs it off its step loop."""
    weights = engine.adapters.load_sync(AdapterRef(content_id, name, path))
    return {"rank": weights.max_rank, "target_modules": list(weights.target_modules), "bytes": weights.nbytes}


def uptime(engine: LLMEngine) -> list[float]:
    u = Uptime.start(engine)
    return [u.started_at, u.monotonic, u.busy_seconds]


def registry_snapshot(engine: LLMEngine, url: str, origin: list[float] | None, engine_type: str | None) -> str | None:
    """The registry entry's JSON; None once the engine drains (through any front-end): the entry must go."""
    if engine.draining:
        return None
    return snapshot(engine, url, Uptime(*origin) if origin else None, engine_type).encode().decode()


def retire_adapter(engine: LLMEngine, content_id: str) -> None:
    unload_retired(engine, content_id)


def metrics(engine: LLMEngine) -> bytes:
    return generate_latest(engine.metrics.registry)


def num_in_flight(engine: LLMEngine) -> int:
    return engine.scheduler.num_running + engine.scheduler.num_waiting


def check_integrity(engine: LLMEngine) -> bool:
    engine.check_integrity()
    return True


def clock(_: LLMEngine) -> float:
    return time.monotonic()


def drain(engine: LLMEngine) -> int:
    """Stop admitting on every front-end (the core refuses new requests from all of them); in-flight requests
    finish. Returns how many are in flight."""
    engine.draining = True
    return num_in_flight(engine)


def is_draining(engine: LLMEngine) -> bool:
    return engine.draining


def counters(engine: LLMEngine) -> dict[str, float]:
    """What tests and benchmarks read from a core in another process."""
    m = engine.metrics
    return {"steps": engine.stats.steps, "tokens": engine.stats.tokens, "busy_seconds": engine.stats.busy_seconds,
            "preemptions": engine.scheduler.num_preemptions, "swap_out_blocks": m.swap_out_blocks._value.get(),
            "kv_used": engine.kv.pool.num_used, "running": engine.scheduler.num_running}


OPS = {f.__name__: f for f in (adapter_state, unload_adapter, load_adapter, uptime, registry_snapshot, retire_adapter,
                                metrics, num_in_flight, check_integrity, clock, counters, drain, is_draining)}
# Run off the step loop (they block on files); everything else runs between steps.
BLOCKING_OPS = frozenset({"load_adapter"})


def engine_info(engine: LLMEngine) -> EngineInfo:
    c = engine.config
    a = engine.adapters
    return EngineInfo(
        model_name=c.model_name, model_dir=str(c.model_dir), engine_id=c.engine_id,
        vocab_size=engine.model.config.vocab_size, max_model_len=engine.max_model_len,
        block_size=engine.kv.block_size, num_blocks=engine.kv.pool.num_blocks, lora_enabled=a is not None,
        adapter_cache_dir=str(a.cache_dir) if a is not None else None, adapter_stores=tuple(c.adapter_stores),
        clamp_tokens=c.scheduler.batch_max_tokens_under_overload, core_pid=os.getpid(),
        admission=engine.load.admission_fields(),
    )
