"""The CPU code paths that the demo kit's build and the test suite are pinned to.

Which SIMD path torch's own kernels (ATen), MKL's GEMMs and oneDNN take depends on the CPU, and fp32
results differ in the last bits between paths. Training amplifies those bits: the same sources built on an
AVX-512 and on an AVX2-only machine gave demo kits 4.5 points apart in exact match. Inference only moves
near-ties, but the tests calibrated on the kit (the fp8 KV gate's agreement, the quality gate's reasons)
sit near such thresholds. Pinned, a machine computes what any other x86-64 machine with AVX2 computes.

AVX2 because every machine we run on has it (AVX-512 is no faster on the Zen 4 we measured, 12.2 s either
way on a training probe; no SIMD at all was 15% slower). This module imports nothing heavy: it must run
before torch is imported (ATen reads its variable on first dispatch, MKL at its first call).
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised kernels: softmax, norms, reductions, optimiser steps
    "MKL_CBWR": "AVX2",  # MKL's GEMMs, conditional-numerical-reproducibility mode on its AVX2 branch
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's kernels
}


def pin(environ: MutableMapping[str, str] = os.environ, *, override: bool = False) -> None:
    """Set the pinned paths in `environ` (by default only where nothing is set: an explicit choice wins)."""
    for k, v in PINNED_ENV.items():
        if override:
            environ[k] = v
        else:
            environ.setdefault(k, v)
