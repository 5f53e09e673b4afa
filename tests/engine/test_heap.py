"""The engine core's heap keeps freed step tensors (services/engine/heap.py): a step's big activations are
reused from the heap instead of coming back as freshly faulted pages."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.heap import SETTINGS, keep_step_memory

ROOT = Path(__file__).resolve().parents[2]
# The engine's step loop on a model whose prefill activations are MBs (hidden 256, 2,048-token steps): a warm-up
# burst, then the minor page faults of a second burst of 128 prompts.
PROBE = """
import resource, sys, torch
from pathlib import Path
if sys.argv[1] == "tuned":
    from services.engine.heap import keep_step_memory
    assert keep_step_memory(), "nothing was set"
from services.modelkit import build_tiny_random
from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from services.engine.engine import LLMEngine
from services.engine.sequence import SamplingParams
model = Path(sys.argv[2])
if not (model / "config.json").exists():
    build_tiny_random(model, arch="llama", seed=0, hidden=256, intermediate=688, layers=2, heads=8, kv_heads=2,
                      vocab_size=512, max_position_embeddings=512)
torch.set_num_threads(2)
engine = LLMEngine(EngineConfig(model_dir=model, served_model_name="m", cache=CacheConfig(memory_bytes=64 * 2**20),
                                scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048,
                                                          interactive_ttft_slo_s=None)), detokenize=False)
gen = torch.Generator().manual_seed(0)
def burst(tag):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(128):
        n = int(torch.randint(40, 120, (1,), generator=gen))
        engine.add_request(f"{tag}{i}", torch.randint(3, 500, (n,), generator=gen).tolist(), params)
    while engine.has_unfinished():
        engine.step()
burst("warm")
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
burst("measured")
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, model: Path) -> int:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(model.parent)}  # no MALLOC_* of ours
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(model)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_step_loop_reuses_its_tensors_pages(tmp_path):
    model = tmp_path / "llama"
    plain, tuned = _faults("plain", model), _faults("tuned", model)
    # measured: ~39,000 faults a burst with glibc's defaults, ~1,500 with the core's settings
    assert plain > 5000, f"glibc's defaults faulted only {plain} pages in the burst: nothing left to save"
    assert tuned < plain / 5, (plain, tuned)


def test_an_operators_malloc_setting_wins():
    var = SETTINGS[-2][1]  # M_TOP_PAD's
    done = keep_step_memory({var: "0"})
    assert var not in done
    assert set(done) == {v for _, v in SETTINGS.values()} - {var}
