"""The engine core's heap keeps freed step tensors (services/engine/heap.py): a step's big activations stay in
the heap for the next step instead of going back to the kernel (and coming back as freshly faulted pages)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.heap import SETTINGS, keep_step_memory

ROOT = Path(__file__).resolve().parents[2]
# A fresh process allocates, writes and frees a 20 MB tensor (a prefill step's MLP activations), then reads
# glibc's own account (mallinfo2): bytes free inside its heap, and the heap's size. Kernel-independent, unlike
# counting page faults (this VM's kernel also takes pages back on its own).
PROBE = """
import ctypes, sys, torch
if sys.argv[1] == "tuned":
    from services.engine.heap import keep_step_memory
    assert keep_step_memory(), "nothing was set"
x = torch.empty(5 * 2**20).fill_(1.0)
del x
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = Info
info = mallinfo2()
print(info.fordblks, info.arena)
"""


def _heap(mode: str) -> tuple[int, int]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # no MALLOC_* of ours
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    free, arena = map(int, out.stdout.split()[-2:])
    return free, arena


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_freed_step_tensor_stays_in_the_heap():
    step = 20 * 2**20
    free, arena = _heap("plain")
    assert free < step, f"glibc's defaults kept {free} bytes free in the heap: nothing left to change"
    free, arena = _heap("tuned")
    assert free >= step and arena >= step, (free, arena)


def test_an_operators_malloc_setting_wins():
    var = SETTINGS[-2][1]  # M_TOP_PAD's
    done = keep_step_memory({var: "0"})
    assert var not in done
    assert set(done) == {v for _, v in SETTINGS.values()} - {var}
