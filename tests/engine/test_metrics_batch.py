"""The engine's batched token metrics (metrics.step_tokens / observe_n) expose what one observe() per token would."""
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.engine.metrics import EngineMetrics, observe_n


def _exposition(registry, expected: bool = False) -> dict:
    """Every sample but the creation times; as `expected`, sums to rounding (n x value against n additions)."""
    out = {}
    for metric in registry.collect():
        for smp in metric.samples:
            if not smp.name.endswith("_created"):
                out[(smp.name, tuple(sorted(smp.labels.items())))] = (
                    pytest.approx(smp.value, rel=1e-12) if expected and smp.name.endswith("_sum") else smp.value)
    return out


def test_observe_n_is_count_observes():
    rng = random.Random(3)
    values = [rng.choice([0.0005, 0.001, 0.0123, 0.04, 0.04, 7.0, 100.0, -1.0]) for _ in range(200)]
    regs = [CollectorRegistry(), CollectorRegistry()]
    hists = [Histogram("h", "d", ["model"], buckets=(0.001, 0.01, 0.04, 1.0), registry=r).labels(model="m") for r in regs]
    for v in values:
        hists[0].observe(v)
    from collections import Counter
    for v, n in Counter(values).items():
        observe_n(hists[1], v, n)
    assert _exposition(regs[1]) == _exposition(regs[0], expected=True)


def test_step_tokens_counts_every_token_and_latency():
    a, b = EngineMetrics("m"), EngineMetrics("m")
    itls = [0.012] * 250 + [0.03, 0.5]
    for v in itls:
        a.itl.observe(v)
    a.generation_tokens.inc(256)
    b.step_tokens(itls, 256)
    b.step_tokens([], 0)
    assert _exposition(b.registry) == _exposition(a.registry, expected=True)
