"""Only a service's own process freezes its start-up heap (services/common/gc_tuning.py): an app built in
another process -- a test's in-process gateway -- leaves that process's collector alone."""
from __future__ import annotations

import gc
import multiprocessing


def _frozen_after_startup(as_service: bool) -> tuple[int, tuple[int, int, int]]:
    from services.common import gc_tuning

    if as_service:
        gc_tuning.service_process()
    gc_tuning.freeze_startup_heap()
    return gc.get_freeze_count(), gc.get_threshold()


def _in_child(as_service: bool) -> tuple[int, tuple[int, int, int]]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_frozen_after_startup, (as_service,))


def test_a_service_process_freezes_its_heap_and_any_other_process_does_not():
    from services.common.gc_tuning import YOUNG

    frozen, thresholds = _in_child(as_service=True)
    assert frozen > 10_000  # the interpreter, the modules: all of it skipped from now on
    assert thresholds == YOUNG != (700, 10, 10)  # and young collections rarer than CPython's default
    assert _in_child(as_service=False) == (0, (700, 10, 10))  # any other process: its collector as it was
    assert gc.get_freeze_count() == 0  # and this (test) process never froze
