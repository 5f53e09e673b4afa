"""The engine core's C heap. A step allocates and frees its activations (torch's CPU allocator caches nothing):
tens of MB a step at a 2,048-token prefill. glibc gives blocks over its mmap threshold their own mappings and
returns a freed heap top to the kernel past its trim threshold, so step tensors kept coming back as fresh pages
-- a page fault and a zeroed page each: 39-102k minor faults and 0.03-0.30 s of system time in a 256-request cold
burst of the core's loop (bench/serving_bench.py's model; docs/engine.md). Kept in the heap they are reused:
0.4-1.5k faults, ~0.01 s, and the loop's CPU 5.3-5.7 -> 5.0-5.2 s a burst."""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("mplex.engine.heap")

# mallopt parameters (malloc.h) and what the core sets them to. The mmap threshold is capped by glibc at 32 MiB
# on 64-bit (a larger value is refused); blocks above it still get their own mapping.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {  # parameter: (value, the environment variable an operator sets it with, which wins)
    M_MMAP_THRESHOLD: (32 * 2**20, "MALLOC_MMAP_THRESHOLD_"),
    M_TRIM_THRESHOLD: (512 * 2**20, "MALLOC_TRIM_THRESHOLD_"),
    M_TOP_PAD: (64 * 2**20, "MALLOC_TOP_PAD_"),
}


def keep_step_memory(env=os.environ) -> dict[str, int]:
    """Keep freed step tensors in this process's heap (glibc only; elsewhere nothing changes). A parameter whose
    environment variable the operator set is left to it. Returns what was set, by variable name."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = {}
    for param, (value, var) in SETTINGS.items():
        if var in env:
            continue
        if mallopt(param, value) == 1:
            done[var] = value
        else:
            log.warning("mallopt refused %s=%d; the core's heap keeps glibc's default", var, value)
    return done
