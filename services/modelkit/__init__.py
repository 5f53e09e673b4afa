"""The demo model kit: a small trained Llama-architecture model, tokenizer and LoRA adapters, built locally.

There is no model hub on our machines, so the platform builds the model it serves in development and
tests. `ensure_demo()` returns the cached kit (building it once); `build_tiny_random` and
`make_random_adapter` make random-weight checkpoints and adapters in seconds for tests/benchmarks.
"""
from services.modelkit.kit import DemoAdapter, DemoKit, build_key, ensure_demo, load_built
from services.modelkit.random_models import build_tiny_random, make_random_adapter

__all__ = ["DemoAdapter", "DemoKit", "build_key", "build_tiny_random", "ensure_demo", "load_built", "make_random_adapter"]
