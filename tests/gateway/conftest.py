"""A real stack for gateway end-to-end tests: two engines on the demo model and one gateway."""
from __future__ import annotations

import pytest

from tests.stack import Stack



@pytest.fixture(scope="module")
def stack(stack_env, demo_kit, tmp_path_factory):
    s = Stack(stack_env, tmp_path_factory.mktemp("stack-logs"))
    try:
        s.engines = [s.engine(demo_kit.base_dir, demo_kit.model_name, f"eng-{i}-{id(s) % 10000}", wait=False)
                     for i in range(2)]
        s.gw = s.gateway(demo_kit.base_dir, demo_kit.model_name, wait=False)
        s.wait_ready(*s.engines, s.gw)
        yield s
    finally:
        s.close()
