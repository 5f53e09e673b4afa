"""`mplex engine ...`: serve a model with the engine."""
from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="The inference engine.")


@app.command()
def serve(
    model: Path = typer.Option(..., help="Hugging Face checkpoint directory (safetensors)"),
    host: str = "127.0.0.1",
    port: int = 8100,
    served_model_name: str = typer.Option(None, help="Name clients use (default: the directory name)"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    weight_dtype: str = typer.Option("auto", help="auto | fp8"),
    device: str = "cpu",
    kv_memory_mb: int = typer.Option(512, help="KV cache budget"),
    swap_space_mb: int = typer.Option(None, help="Host tier for preempted sequences' KV (default: as large as the KV cache, at most 4 GiB; 0 = off, always recompute)"),
    preemption_mode: str = typer.Option("auto", help="auto (swap or recompute by measured cost) | swap | recompute"),
    prompt_sharing: bool = typer.Option(True, help="Identical concurrent prompts (n > 1) fork one computed prompt copy-on-write"),
    kv_dtype: str = typer.Option("auto", help="KV cache storage: auto (the model dtype) | fp8 (e4m3, per-block "
                                 "per-kv-head scales; needs a passing `mplex engine kv-gate` verdict for this model)"),
    skip_kv_gate: bool = typer.Option(False, help="Serve --kv-dtype fp8 without a passing kv-gate verdict (logged)"),
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_batched_tokens: int = 2048,
    max_model_len: int = typer.Option(None, help="Context length (default: the model's)"),
    engine_id: str = typer.Option("engine-0", help="Identity in the registry and usage records"),
    redis_url: str = typer.Option(None, envvar="MPLEX_REDIS_URL", help="Registry to heartbeat into (none: standalone)"),
    advertise_url: str = typer.Option(None, envvar="MPLEX_ENGINE_ADVERTISE_URL", help="URL the gateway should use (default: http://HOST:PORT)"),
    max_loras: int = typer.Option(8, help="Device adapter slots"),
    max_cpu_loras: int = typer.Option(64, help="Adapters kept in host memory"),
    max_lora_rank: int = 64,
    lora_cpu_kernel: str = typer.Option("auto", help="CPU LoRA kernel: auto (native C when it builds, else torch) | native | torch"),
    cpu_attention: str = typer.Option("auto", help="CPU decode attention: auto (native C when it builds, else torch) | native | torch"),
    cpu_packed_gemm: bool = typer.Option(True, help="CPU fp32 projections through oneDNN with prepacked weights where it measures faster at load (--no-cpu-packed-gemm: torch's F.linear)"),
    log_level: str = "info",
    scheduling_policy: str = typer.Option("fair", help="fair (tenants share the batch by weight) | fcfs (arrival order)"),
    interactive_ttft_slo_s: float = typer.Option(2.0, help="Refuse (503 engine_overloaded) interactive requests whose estimated TTFT is over this; 0 = never"),
    batch_ttft_slo_s: float = typer.Option(600.0, help="The same for the batch class; 0 = never"),
    batch_max_tokens_under_overload: int = typer.Option(256, help="max_tokens clamp for batch requests under sustained overload; 0 = none"),
    max_step_ms: float = typer.Option(250.0, help="Wall-time target per step: prompt work is capped at what the measured "
                                      "step cost leaves beside the decodes, so a request arriving mid-step waits out "
                                      "a short step; 0 = token budget only"),
    batch_prompt_ms: float = typer.Option(2.0, help="Batch-class prompt work per step is capped at what this much compute "
                                          "buys by the measured step cost (beside the 128-token cap), so an "
                                          "interactive request arriving mid-step waits out a short step; 0 = tokens only"),
    failpoint: list[str] = typer.Option([], help="Tests only (refused in prod): NAME=TOKEN_ID, e.g. step_error=7 (see EngineConfig.failpoints)"),
    frontends: int = typer.Option(1, min=0, help="HTTP front-end processes beside the engine core process "
                                  "(0: the HTTP server shares the core's process, as before the split)"),
    core_threads: int = typer.Option(0, min=0, help="torch threads of the engine core (0: torch's default, "
                                     "which follows OMP_NUM_THREADS)"),
    core_nice: int = typer.Option(5, min=0, max=19, help="CPU niceness of the engine core, which also runs at "
                                  "SCHED_BATCH (0: neither): the step loop is throughput work and yields the CPU to "
                                  "the front-ends, the gateway and Redis, which answer within milliseconds"),
    async_scheduling: bool = typer.Option(False, help="Schedule and build step N+1's inputs while step N's forward "
                                          "runs, post-process step N during step N+1 (token-identical outputs)"),
    speculative: str = typer.Option("off", help="Speculative decoding (lossless, adaptive per sequence and to load): "
                                    "off | ngram (prompt lookup) | draft_model (a small model, "
                                    "--speculative-draft-model) | auto (both; per base model / adapter the drafter "
                                    "its gate verdicts chose)"),
    speculative_draft_model: Path = typer.Option(None, help="Draft model checkpoint (same tokenizer as --model; "
                                                 "default: the demo kit's, beside its base model)"),
    num_speculative_tokens: int = typer.Option(4, help="Most draft tokens per sequence and step"),
    speculative_max_running: int = typer.Option(32, help="No speculation from this many running sequences on"),
    skip_spec_gate: bool = typer.Option(False, help="Speculate for every model/adapter, not only where `mplex engine "
                                        "spec-gate` found it exact and faster"),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", min=1,
                                             help="Shard the model over N processes / GPUs (rank 0 is the engine core)"),
    tp_backend: str = typer.Option("auto", help="Tensor-parallel collectives: auto (nccl on CUDA, gloo on CPU) | gloo | nccl"),
    tp_timeout_s: float = typer.Option(60.0, help="A tensor-parallel collective waiting longer fails the engine (dead, not hung)"),
) -> None:
    """Load the model and serve the internal stream + OpenAI endpoints."""
    from services.common.settings import get_settings

    settings = get_settings()
    config = _engine_config(dict(locals()), settings)
    _check_kv_gate(settings.home, model, dtype, weight_dtype, kv_dtype, skip_kv_gate)
    if frontends:
        _run_split(config, settings, host, port, advertise_url, redis_url, log_level, frontends, core_threads,
                   core_nice)
    else:
        _run(config, settings, host, port, advertise_url, redis_url, log_level)


def _engine_config(options: dict, settings):
    """The EngineConfig of `serve`'s options (its parameters, by name)."""
    from types import SimpleNamespace

    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, ParallelConfig, SchedulerConfig

    o = SimpleNamespace(**options)
    return EngineConfig(
        model_dir=o.model,
        served_model_name=o.served_model_name,
        dtype=o.dtype,
        weight_dtype=o.weight_dtype,
        device=o.device,
        cache=CacheConfig(block_size=o.block_size, memory_bytes=o.kv_memory_mb * 2**20, kv_dtype=o.kv_dtype,
                          swap_space_bytes=None if o.swap_space_mb is None else o.swap_space_mb * 2**20,
                          preemption_mode=o.preemption_mode, enable_prompt_sharing=o.prompt_sharing),
        scheduler=SchedulerConfig(max_num_seqs=o.max_num_seqs, max_num_batched_tokens=o.max_batched_tokens, max_model_len=o.max_model_len,
                                  policy=o.scheduling_policy, interactive_ttft_slo_s=o.interactive_ttft_slo_s or None,
                                  batch_ttft_slo_s=o.batch_ttft_slo_s or None,
                                  batch_max_tokens_under_overload=o.batch_max_tokens_under_overload or None,
                                  max_step_s=o.max_step_ms / 1000 if o.max_step_ms else None,
                                  lower_class_prompt_s=o.batch_prompt_ms / 1000 if o.batch_prompt_ms else None),
        lora=LoraConfig(max_loras=o.max_loras, max_cpu_loras=o.max_cpu_loras, max_lora_rank=o.max_lora_rank,
                        cpu_kernel=o.lora_cpu_kernel),
        engine_id=o.engine_id,
        adapter_stores=(settings.storage_url,),
        adapter_base_names=_base_names(o.model, o.served_model_name),
        cpu_attention=o.cpu_attention,
        cpu_packed_gemm=o.cpu_packed_gemm,
        failpoints=_failpoints(o.failpoint, settings.env),
        async_scheduling=o.async_scheduling,
        speculative=_speculative_config(settings.home, o.model, o.speculative, o.num_speculative_tokens,
                                        o.speculative_max_running, o.skip_spec_gate, o.speculative_draft_model),
        parallel=ParallelConfig(tensor_parallel_size=o.tensor_parallel_size, backend=o.tp_backend,
                                collective_timeout_s=o.tp_timeout_s),
    )


def _uvicorn_options(log_level: str) -> dict:
    # Keep-alive longer than the gateway's pool keeps idle connections (30 s): the gateway must never send a
    # request on a connection the engine is closing (it would be lost, and lost requests are not retried).
    # The streams socket (engine_wire.STREAMS_PATH): frames up to STREAMS_MAX_FRAME, not compressed (a frame per
    # step would cost a deflate per step on both sides for a loopback or in-cluster hop).
    from services.common.engine_wire import STREAMS_MAX_FRAME

    return dict(log_level=log_level, timeout_graceful_shutdown=30, timeout_keep_alive=75, ws_max_size=STREAMS_MAX_FRAME,
                ws_per_message_deflate=False)


def _advertised(host: str, port: int, advertise_url: str | None) -> str:
    return advertise_url or f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def _run_split(config, settings, host: str, port: int, advertise_url: str | None, redis_url: str | None,
               log_level: str, frontends: int, core_threads: int, core_nice: int) -> None:
    from services.common.internal_auth import engine_tokens
    from services.common.logging import configure
    from services.engine.launcher import FrontendSpec, serve

    configure("engine", log_level)
    spec = FrontendSpec(address="", engine_tokens=tuple(engine_tokens(settings)), registry_url=redis_url,
                        advertise_url=_advertised(host, port, advertise_url), max_body_bytes=settings.max_request_bytes,
                        max_header_bytes=settings.max_header_bytes, uvicorn=_uvicorn_options(log_level),
                        log_level=log_level)
    raise typer.Exit(serve(config, spec, host=host, port=port, frontends=frontends, core_threads=core_threads,
                           core_nice=core_nice))


def _run(config, settings, host: str, port: int, advertise_url: str | None, redis_url: str | None, log_level: str) -> None:
    import uvicorn

    from services.common.gc_tuning import service_process
    from services.common.internal_auth import engine_tokens
    from services.common.logging import configure
    from services.engine.async_engine import AsyncEngine
    from services.engine.engine import LLMEngine
    from services.engine.heap import keep_step_memory
    from services.engine.server import create_app

    service_process()
    keep_step_memory()  # the step loop runs in this process (services/engine/heap.py)
    log_config = configure("engine", log_level)
    url = _advertised(host, port, advertise_url)
    # If the step loop ever stops (its state could not be trusted after an error), the process exits so
    # that whatever runs it (`make up`'s supervisor, Kubernetes) starts a fresh one.
    core = AsyncEngine(LLMEngine(config), on_death=_exit_soon)
    app_ = create_app(core, engine_tokens=engine_tokens(settings), registry_url=redis_url, advertise_url=url,
                      max_body_bytes=settings.max_request_bytes, max_header_bytes=settings.max_header_bytes)
    from services.common.http_limits import http_protocol

    uvicorn.run(app_, host=host, port=port, log_config=log_config, http=http_protocol(settings.max_header_bytes),
                **_uvicorn_options(log_level))


@app.command("kv-gate")
def kv_gate(
    model: Path = typer.Option(None, help="Checkpoint directory (default: the demo kit's base model)"),
    dtype: str = typer.Option("float32", help="Compute dtype the engines will serve with"),
    weight_dtype: str = typer.Option("auto", help="auto | fp8 (as the engines will serve)"),
    eval_file: list[Path] = typer.Option([], help="JSONL eval sets ({\"prompt\": ...} per line), run on the base "
                                         "model; default: the demo kit's base and adapter eval sets"),
    min_agreement: float = typer.Option(0.98, help="Greedy token agreement fp8 KV vs full-precision KV required"),
    max_new_tokens: int = 48,
    adapter_items: int = typer.Option(200, help="Demo kit: held-out items per adapter task"),
    record: bool = typer.Option(True, help="Record the verdict, which `serve --kv-dtype fp8` requires"),
) -> None:
    """Check that an fp8 KV cache keeps this model's greedy outputs (the gate before `serve --kv-dtype fp8`)."""
    import json

    from services.engine.kv_gate import KvEvalSet, check_fp8_kv, demo_eval_sets, record_verdict
    from services.common.settings import get_settings

    settings = get_settings()
    kit = None
    if model is None or not eval_file:
        from services.modelkit import ensure_demo

        kit = ensure_demo(settings.home, progress=False)
        model = model or kit.base_dir
    if eval_file:
        from services.common.prompting import PromptBuilder

        builder = PromptBuilder(model)
        sets = []
        for path in eval_file:
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            sets.append(KvEvalSet(path.stem, [builder.chat_ids([{"role": "user", "content": r["prompt"]}]) for r in rows],
                                  None, [r["expected"] for r in rows] if all("expected" in r for r in rows) else None))
    elif kit is not None and Path(model).resolve() == Path(kit.base_dir).resolve():
        sets = demo_eval_sets(kit, adapter_items)
    else:
        raise typer.BadParameter("give --eval-file for a model other than the demo kit's", param_hint="--eval-file")
    result = check_fp8_kv(model, sets, dtype=dtype, weight_dtype=weight_dtype, min_agreement=min_agreement,
                          max_new_tokens=max_new_tokens)
    for name, fig in result.per_set.items():
        typer.echo(f"  {name:<12} items {int(fig['items']):>4}  token agreement {fig['token_agreement']:.4f}")
    typer.echo(result.message)
    if record:
        typer.echo(f"verdict recorded: {record_verdict(settings.home, model, result)}")
    raise typer.Exit(0 if result.passed else 1)


@app.command("spec-gate")
def spec_gate(
    model: Path = typer.Option(None, help="Checkpoint directory (default: the demo kit's base model)"),
    method: str = typer.Option("ngram", help="The drafter to gate: ngram | draft_model | auto (both)"),
    min_gain: float = typer.Option(1.1, help="TPOT plain / speculative required (one request at a time)"),
    items: int = typer.Option(24, help="Eval items per set"),
    record: bool = typer.Option(True, help="Record the verdict `serve --speculative` reads"),
) -> None:
    """Measure, per eval set (base model, each adapter), whether speculation is exact and faster; record
    where it is on (services/engine/spec/gate.py). Demo kit eval sets."""
    from services.common.settings import get_settings
    from services.engine.config import DRAFTERS
    from services.engine.kv_gate import demo_eval_sets
    from services.engine.spec.gate import check_speculation, record_verdict
    from services.modelkit import ensure_demo

    settings = get_settings()
    kit = ensure_demo(settings.home, progress=False)
    model = model or kit.base_dir
    if Path(model).resolve() != Path(kit.base_dir).resolve():
        raise typer.BadParameter("the speculative gate runs the demo kit's eval sets only", param_hint="--model")
    if method not in (*DRAFTERS, "auto"):
        raise typer.BadParameter(f"expected one of {', '.join(DRAFTERS)}, auto", param_hint="--method")
    for m in DRAFTERS if method == "auto" else (method,):
        result = check_speculation(model, demo_eval_sets(kit, items), method=m, min_gain=min_gain, max_items=items,
                                   draft_model=kit.draft_dir if m == "draft_model" else None)
        typer.echo(result.message)
        if record:
            typer.echo(f"verdict recorded: {record_verdict(settings.home, model, result)}")


def _speculative_config(home: Path, model: Path, method: str, num_tokens: int, max_running: int, skip: bool,
                        draft_model: Path | None):
    from services.engine.config import SpeculativeConfig

    if method in ("draft_model", "auto") and draft_model is None:
        draft_model = _kit_draft_model(model)
    enabled_for, drafters = _spec_enabled_for(home, model, method, skip)
    return SpeculativeConfig(method=method, num_speculative_tokens=num_tokens, max_running=max_running,
                             draft_model=draft_model, enabled_for=enabled_for, drafters=drafters)


def _kit_draft_model(model: Path) -> Path:
    """A demo kit's draft model lies beside its base model (modelkit/kit.py)."""
    from services.modelkit.kit import DRAFT_DIR

    draft = Path(model).parent / DRAFT_DIR
    if not (draft / "config.json").exists():
        raise typer.BadParameter(f"no draft model beside {model}; pass --speculative-draft-model",
                                 param_hint="--speculative-draft-model")
    return draft


def _spec_enabled_for(home: Path, model: Path, method: str, skip: bool):
    """Speculation only where the gate measured it exact and faster; without a verdict, nowhere (logged).
    Returns (enabled keys or None for all, the per-key drafters of `auto`)."""
    if method == "off" or skip:
        return None, ()
    import logging

    from services.engine.spec.gate import chosen_drafters, enabled_keys

    log = logging.getLogger("mplex.engine")
    chosen = chosen_drafters(home, model) if method == "auto" else None
    keys = chosen[0] if chosen is not None else None if method == "auto" else enabled_keys(home, model, method)
    if keys is None:
        log.warning("--speculative %s: no gate verdict for %s, so no speculation; run `mplex engine spec-gate` "
                    "(or pass --skip-spec-gate)", method, model)
        return (), ()
    log.info("speculative gate: on for %d of the model's base/adapters", len(keys))
    return keys, chosen[1] if chosen is not None else ()


def _check_kv_gate(home: Path, model: Path, dtype: str, weight_dtype: str, kv_dtype: str, skip: bool) -> None:
    """fp8 KV is turned on per model only after its agreement gate passed (services/engine/kv_gate.py)."""
    if kv_dtype != "fp8":
        return
    from services.engine.kv_gate import KvGateRequired, require_verdict

    try:
        verdict = require_verdict(home, model, dtype, weight_dtype)
    except KvGateRequired as exc:
        if not skip:
            raise typer.BadParameter(str(exc), param_hint="--kv-dtype") from None
        import logging

        logging.getLogger("mplex.engine").warning("serving fp8 KV without a passing gate verdict (--skip-kv-gate): %s", exc)
        return
    import logging

    logging.getLogger("mplex.engine").info("fp8 KV gate verdict: agreement %.4f (>= %.4f) measured %s",
                                           verdict["agreement"], verdict["min_agreement"], verdict.get("measured_at"))


def _base_names(model: Path, served_name: str | None) -> tuple[str, ...]:
    """The names the upload validator accepts for this base (services.adapters.base_model): its served name,
    its directory (path or last component) and the name its config.json records."""
    import json

    raw = json.loads((Path(model) / "config.json").read_text())
    return tuple(n for n in (served_name, str(model), str(Path(model).resolve()), raw.get("_name_or_path")) if n)


def _failpoints(specs: list[str], env: str) -> tuple[tuple[str, int], ...]:
    if specs and env == "prod":
        raise typer.BadParameter("failpoints are for tests; they are refused when MPLEX_ENV=prod", param_hint="--failpoint")
    out = []
    for spec in specs:
        name, _, token = spec.partition("=")
        if not token.isdigit():
            raise typer.BadParameter(f"expected NAME=TOKEN_ID, got {spec!r}", param_hint="--failpoint")
        out.append((name, int(token)))
    return tuple(out)


def _exit_soon() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down (the registry entry goes first), then exits
