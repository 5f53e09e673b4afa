"""The step cost fit and the wall-time bound it gives (step_time.py)."""
from __future__ import annotations

import pytest

from services.engine.config import ConfigError, SchedulerConfig
from services.engine.step_time import MIN_PROMPT_TOKENS, StepCostModel, StepTimeBound


def test_the_fit_recovers_a_step_cost_line():
    m = StepCostModel()
    for _ in range(300):
        for tokens in (8, 200, 1000):
            m.observe(tokens, 0.004 + 2e-4 * tokens)
    fixed, per_token = m.estimate()
    assert fixed == pytest.approx(0.004, rel=0.05) and per_token == pytest.approx(2e-4, rel=0.02)


def test_the_bound_leaves_room_for_the_decodes_and_tightens_as_steps_slow_down():
    bound = StepTimeBound(0.25)
    for _ in range(300):
        for tokens in (8, 200, 1000):
            bound.cost.observe(tokens, 0.002 + 1e-4 * tokens)
    assert bound.prompt_tokens(0) == pytest.approx(2480, abs=40)  # (0.25 - 0.002) / 1e-4
    assert bound.prompt_tokens(1000) == pytest.approx(1480, abs=40)  # the decodes' share is theirs
    for _ in range(300):  # the machine slows down five-fold (neighbours took the cores)
        for tokens in (8, 200, 1000):
            bound.cost.observe(tokens, 0.01 + 5e-4 * tokens)
    assert bound.prompt_tokens(0) == pytest.approx(480, abs=20)
    assert bound.prompt_tokens(2000) == MIN_PROMPT_TOKENS  # decodes alone fill the target: prefill still moves


def test_idle_and_failed_steps_teach_nothing():
    from services.engine.kv.block_pool import BlockPool
    from services.engine.kv.manager import KVCacheManager
    from services.engine.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_step_s=0.25), KVCacheManager(BlockPool(8), 4), 64)
    before = sched.step_cost.estimate()
    sched.observe_step(0, 1.0)
    sched.observe_step(100, 0.0)
    assert sched.step_cost.estimate() == before
    sched.observe_step(100, 0.5)  # a real step does
    assert sched.step_cost.estimate() != before


def test_the_target_must_be_positive():
    with pytest.raises(ConfigError, match="max_step_s"):
        SchedulerConfig(max_step_s=0)
    assert SchedulerConfig().max_step_s is None  # off unless asked for (`mplex engine serve` asks: 250 ms)


def test_the_served_engine_bounds_its_steps_and_its_batch_prompt_work_in_time(demo_kit):
    """`mplex engine serve`'s defaults reach the scheduler: a 250 ms step target and 2 ms of batch prompt work
    per step (class_yield.py), both read off one fitted cost; 0 turns each off."""
    import inspect

    from services.common.settings import get_settings
    from services.engine.cli import _engine_config, serve

    options = {name: getattr(p.default, "default", p.default) for name, p in inspect.signature(serve).parameters.items()}
    options.update(model=demo_kit.base_dir, served_model_name=demo_kit.model_name)
    sched = _engine_config(options, get_settings()).scheduler
    assert (sched.max_step_s, sched.lower_class_prompt_s) == (0.25, 0.002)
    off = _engine_config({**options, "max_step_ms": 0, "batch_prompt_ms": 0}, get_settings()).scheduler
    assert (off.max_step_s, off.lower_class_prompt_s) == (None, None)
