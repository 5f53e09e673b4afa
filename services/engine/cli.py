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
    log_level: str = "info",
) -> None:
    """Load the model and serve the internal stream + OpenAI endpoints."""
    import uvicorn

    from services.engine.async_engine import AsyncEngine
    from services.engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from services.engine.engine import LLMEngine
    from services.engine.server import create_app

    config = EngineConfig(
        model_dir=model,
        served_model_name=served_model_name,
        dtype=dtype,
        weight_dtype=weight_dtype,
        device=device,
        cache=CacheConfig(block_size=block_size, memory_bytes=kv_memory_mb * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens, max_model_len=max_model_len),
        lora=LoraConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank,
                        cpu_kernel=lora_cpu_kernel),
        engine_id=engine_id,
        cpu_attention=cpu_attention,
    )
    from services.common.logging import configure

    log_config = configure("engine", log_level)
    url = advertise_url or f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    app_ = create_app(AsyncEngine(LLMEngine(config)), registry_url=redis_url, advertise_url=url)
    uvicorn.run(app_, host=host, port=port, log_level=log_level, log_config=log_config, timeout_graceful_shutdown=30)
