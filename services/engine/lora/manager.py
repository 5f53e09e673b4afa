"""Adapter tiers: device slots holding stacked LoRA weights, a host-memory LRU, loads off the step loop.

Adapters are identified by content id. A running sequence pins its adapter's slot; unpinned slots
are reused least-recently-used first. Loads (fetch + validate + convert) run on a worker thread; the
step loop only collects finished loads and copies host tensors into a slot when one is needed.
All state below is touched by the step-loop thread only, except the completion queue.
"""
from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.lora_format import CONFIG_FILE, WEIGHTS_FILE, AdapterFormatError
from services.engine.config import ConfigError, LoraConfig, ModelConfig
from services.engine.kernels import sgmv_native
from services.engine.lora.cpu_slots import CpuSlotStacks
from services.engine.lora.native_slots import NativeSlotTable
from services.engine.lora.sources import is_local
from services.engine.lora.weights import LoraArrays, LoraWeights, read_lora, to_weights
from services.engine.sequence import AdapterRef, Sequence

log = logging.getLogger("mplex.engine.lora")


@dataclass(slots=True)
class ModuleStack:
    """One projection of one layer across all slots (the SGMV kernels' weight operands)."""

    a: torch.Tensor  # [slots, max_rank, in]
    b: torch.Tensor  # [slots, out, max_rank]
    ranks: torch.Tensor  # [slots] int32; 0 = this slot's adapter does not target this module


# Projections that read the same input are applied as one group. On the CPU a group's adapters are
# applied by the native C kernel from per-slot exact-rank buffers (native_slots.py) or, where it cannot
# build or the dtype is not fp32, from rank-class stacks with a few batched torch ops per step
# (cpu_slots.py). On CUDA each slice keeps its own per-slot stack and the Triton kernels run per slice
# with an output offset.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def group_slices(dims: dict[str, tuple[int, int]]) -> dict[str, list[tuple[str, int, int]]]:
    """group -> (module, output offset, output size) of each part of the group's fused output."""
    out = {}
    for group, modules in GROUPS.items():
        off, parts = 0, []
        for m in modules:
            parts.append((m, off, dims[m][1]))
            off += dims[m][1]
        out[group] = parts
    return out


@dataclass(frozen=True, slots=True)
class LoadEvent:
    content_id: str
    seconds: float
    ok: bool


class AdapterManager:
    def __init__(
        self,
        model: ModelConfig,
        config: LoraConfig,
        *,
        dtype: torch.dtype,
        device: str,
        cache_dir: Path | None = None,
        wake: threading.Event | None = None,
        base_names: tuple[str, ...] | None = None,
    ):
        self.model = model
        self.base_names = base_names  # what an adapter may say its base is (None: not checked)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.cache_dir = Path(cache_dir or tempfile.mkdtemp(prefix="mplex-adapters-"))
        self.wake = wake  # set when a load finishes, so an idle step loop wakes up
        n, r = config.max_loras, config.max_lora_rank
        dims = self._module_dims(model)
        self.fused = device == "cpu"
        self.slices = group_slices(dims)
        # CPU: native per-slot buffers or torch rank-class stacks per group. CUDA: stacks[layer][module],
        # the SGMV kernels' operands.
        self.cpu: NativeSlotTable | CpuSlotStacks | None = None
        self.cpu_kernel = ""  # "native" or "torch" on the CPU
        self.stacks: list[dict[str, ModuleStack]] = []
        if self.fused:
            kernel = self._native_kernel(config, dtype)
            if kernel is not None:
                self.cpu = NativeSlotTable(model.num_layers, self.slices, max_slots=n, kernel=kernel)
                self.cpu_kernel = "native"
            else:
                self.cpu = CpuSlotStacks(model.num_layers, self.slices, dims, max_rank=r, max_slots=n, dtype=dtype, device=device)
                self.cpu_kernel = "torch"
        else:
            for _ in range(model.num_layers):
                self.stacks.append({
                    module: ModuleStack(
                        a=torch.zeros(n, r, d_in, dtype=dtype, device=device),
                        b=torch.zeros(n, d_out, r, dtype=dtype, device=device),
                        ranks=torch.zeros(n, dtype=torch.int32, device=device),
                    )
                    for module, (d_in, d_out) in dims.items()
                })
        self._host: OrderedDict[str, LoraWeights] = OrderedDict()
        self._slot_of: dict[str, int] = {}
        self._owner: list[str | None] = [None] * n
        self._pins = [0] * n
        self._idle_slots: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n))  # unpinned, LRU first
        self._loading: set[str] = set()
        self._wanted: set[str] = set()  # content ids the queue's next admissions need (see want)
        self._failed: dict[str, AdapterFormatError] = {}
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        # One thread reads, checks and packs adapters: that work is mostly Python holding the GIL, so a second
        # one adds no loads per second, only contention. Measured on 2 cores, a fixed decode step took 3-5 ms
        # alone, 9-18 ms beside one loader thread loading continuously, and 44-255 ms beside two (their
        # GIL hand-offs and the step's OpenMP team fighting over the cores). Remote downloads, which wait on
        # the network rather than the CPU, run on their own threads first (`_fetch_then_load`).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self._fetchers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lora-fetch")
        self.load_events: list[LoadEvent] = []  # drained by metrics
        self.slot_loads = 0

    @staticmethod
    def _native_kernel(config: LoraConfig, dtype: torch.dtype) -> sgmv_native.NativeSgmv | None:
        if config.cpu_kernel == "torch":
            return None
        if dtype != torch.float32:
            if config.cpu_kernel == "native":
                raise ConfigError(f"the native CPU LoRA kernel is fp32 only; the engine runs in {dtype}")
            return None
        try:
            return sgmv_native.load()
        except sgmv_native.NativeKernelUnavailable as exc:
            if config.cpu_kernel == "native":
                raise ConfigError(f"lora cpu_kernel=native, but {exc}") from exc
            log.warning("native CPU LoRA kernel unavailable, using the torch path: %s", exc)
            return None

    # -- host tier -----------------------------------------------------------------------------
    def request(self, ref: AdapterRef, *, evict: bool = False) -> None:
        """Make sure the adapter is host-resident or on its way, if the host tier has a free entry for
        it; raises if it is known to be bad. Only `want`, which knows the queue's order, evicts to make
        room: a request evicting on arrival would push out adapters that requests ahead of it need."""
        self.poll()
        cid = ref.content_id
        if cid in self._failed:
            raise self._failed[cid]
        if cid in self._host:
            self._host.move_to_end(cid)
            return
        if cid in self._loading:
            return
        if not ref.path:
            raise AdapterFormatError("unknown_adapter", f"adapter {ref.name or cid[:12]} is not loaded and has no storage path")
        if not self._make_room(evict):
            return
        self._loading.add(cid)
        if is_local(ref.path) and self.config.inline_loads:
            self._load(ref)  # its result waits in `_done` for the next poll, as a loader thread's would
        elif is_local(ref.path):
            self._pool.submit(self._load, ref)
        else:
            self._fetchers.submit(self._fetch_then_load, ref)

    def want(self, refs: list[AdapterRef]) -> None:
        """The adapters the next admissions need, most urgent first (at most `host_room()` of them):
        each is loaded unless resident, and no load evicts one of them from the host tier. A bad one
        stays recorded as failed; `poll` reports it."""
        self._wanted = {r.content_id for r in refs}
        for ref in refs:
            try:
                self.request(ref, evict=True)
            except AdapterFormatError:
                pass

    def host_room(self) -> int:
        """How many adapters the host tier can hold besides those pinned by running sequences."""
        return max(1, self.config.max_cpu_loras - self.num_pinned)

    def _victim(self, *, spare_wanted: bool) -> str | None:
        """The least recently used host entry nothing running pins (and, with `spare_wanted`, that no
        queued request wants), or None."""
        for cid in self._host:
            slot = self._slot_of.get(cid)
            if (slot is None or self._pins[slot] == 0) and not (spare_wanted and cid in self._wanted):
                return cid
        return None

    def _make_room(self, evict: bool) -> bool:
        """A host entry for one more load (counting the loads in flight). With `evict`, the least recently
        used adapter that nothing running pins and no queued request wants makes way. False if none."""
        while len(self._host) + len(self._loading) >= self.config.max_cpu_loras:
            if not evict:
                return False
            victim = self._victim(spare_wanted=True)
            if victim is None:
                return False
            self._host.pop(victim)
        return True

    def load_sync(self, ref: AdapterRef) -> LoraWeights:
        """Load an adapter now (internal load endpoint); errors raise. Safe to call from any thread."""
        weights = self._read(ref)
        self._done.put((ref.content_id, weights, 0.0))
        return weights

    def _fetch_then_load(self, ref: AdapterRef) -> None:
        t0 = time.perf_counter()
        try:
            self._fetch(ref)
        except Exception as exc:
            log.exception("fetching adapter %s failed", ref.content_id[:12])
            self._finish(ref, AdapterFormatError("load_failed", f"could not fetch adapter: {exc}"), t0)
            return
        try:
            self._pool.submit(self._load, ref, t0)
        except RuntimeError:  # shut down meanwhile
            pass

    def _load(self, ref: AdapterRef, t0: float | None = None) -> None:
        t0 = time.perf_counter() if t0 is None else t0
        try:
            result: LoraWeights | AdapterFormatError = self._read(ref)
        except AdapterFormatError as exc:
            result = exc
        except Exception as exc:  # I/O or decoding trouble: still a refusal of this adapter only
            log.exception("loading adapter %s failed", ref.content_id[:12])
            result = AdapterFormatError("load_failed", f"could not load adapter: {exc}")
        self._finish(ref, result, t0)

    def _finish(self, ref: AdapterRef, result: LoraWeights | AdapterFormatError, t0: float) -> None:
        self._done.put((ref.content_id, result, time.perf_counter() - t0))
        if self.wake is not None:
            self.wake.set()

    def _read(self, ref: AdapterRef) -> LoraWeights:
        path = self._fetch(ref)
        arrays = self._local_part(read_lora(path, self.model, max_rank=self.config.max_lora_rank, name=ref.name,
                                            expected_content_id=ref.content_id, base_names=self.base_names))
        if isinstance(self.cpu, NativeSlotTable):  # laid out for a slot here, off the step loop
            return self.cpu.pack(arrays)
        return to_weights(arrays, self.dtype)

    def _fetch(self, ref: AdapterRef) -> Path:
        """A local directory with the adapter's two files; remote URIs are copied into the cache once."""
        uri = ref.path or ""
        if is_local(uri):
            return Path(uri.removeprefix("file://"))
        import fsspec

        target = self.cache_dir / ref.content_id
        if (target / WEIGHTS_FILE).exists():
            return target
        tmp = Path(tempfile.mkdtemp(dir=self.cache_dir))
        fs, root = fsspec.core.url_to_fs(uri)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            fs.get(f"{root.rstrip('/')}/{name}", str(tmp / name))
        try:
            tmp.rename(target)
        except OSError:  # another load won the race
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def poll(self) -> list[tuple[str, AdapterFormatError]]:
        """Collect finished loads; returns the adapters that failed since the last poll."""
        failures = []
        while True:
            try:
                cid, result, seconds = self._done.get_nowait()
            except queue.Empty:
                return failures
            self._loading.discard(cid)
            if isinstance(result, AdapterFormatError):
                self._failed[cid] = result
                failures.append((cid, result))
                self.load_events.append(LoadEvent(cid, seconds, False))
                continue
            self._host[cid] = result
            self._host.move_to_end(cid)
            self.load_events.append(LoadEvent(cid, seconds, True))
            self._evict_host()

    def _evict_host(self) -> None:
        """Back under the limit after a load (a synchronous load may bypass `_make_room`): unwanted
        victims first, then any the running sequences do not pin."""
        while len(self._host) > self.config.max_cpu_loras:
            victim = self._victim(spare_wanted=True) or self._victim(spare_wanted=False)
            if victim is None:
                return
            self._host.pop(victim)

    def forget_failure(self, content_id: str) -> None:
        self._failed.pop(content_id, None)

    # -- device slots (the scheduler's AdapterSlots protocol) ------------------------------------
    def slot_of(self, content_id: str) -> int | None:
        return self._slot_of.get(content_id)

    def acquire(self, seq: Sequence) -> int | None:
        assert seq.adapter is not None
        cid = seq.adapter.content_id
        slot = self._slot_of.get(cid)
        if slot is None:
            weights = self._host.get(cid)
            if weights is None or not self._idle_slots:
                return None
            slot = self._install(weights)
        self._pin(slot)
        if cid in self._host:  # a slot-resident adapter may have left the host tier; the slot is what counts
            self._host.move_to_end(cid)
        return slot

    def release(self, seq: Sequence) -> None:
        assert seq.adapter is not None
        slot = self._slot_of[seq.adapter.content_id]
        self._pins[slot] -= 1
        assert self._pins[slot] >= 0
        if self._pins[slot] == 0:
            self._idle_slots[slot] = None  # most recently used end
            if self.cpu is not None:
                self.cpu.deactivate(slot)

    def _pin(self, slot: int) -> None:
        if self._pins[slot] == 0:
            del self._idle_slots[slot]
            if self.cpu is not None:
                self.cpu.activate(slot)
        self._pins[slot] += 1

    def _install(self, weights: LoraWeights) -> int:
        slot, _ = self._idle_slots.popitem(last=False)
        self._idle_slots[slot] = None  # stays idle until pinned by the caller
        old = self._owner[slot]
        if old is not None:
            del self._slot_of[old]
        self._write_slot(slot, weights)
        self._owner[slot] = weights.content_id
        self._slot_of[weights.content_id] = slot
        self.slot_loads += 1
        return slot

    def _write_slot(self, slot: int, weights: LoraWeights) -> None:
        """Put the adapter's weights in device slot `slot` (whatever it held is overwritten)."""
        if self.cpu is not None:
            self.cpu.install(slot, weights)
        for layer, stacks in enumerate(self.stacks):
            for module, stack in stacks.items():
                pair = weights.tensors.get((layer, module))
                if pair is None:
                    stack.ranks[slot] = 0
                    continue
                a, b = pair
                r = a.shape[0]
                stack.a[slot, :r].copy_(a, non_blocking=True)
                stack.b[slot, :, :r].copy_(b, non_blocking=True)
                stack.ranks[slot] = r

    def unload(self, content_id: str) -> bool:
        """Drop an adapter from both tiers unless a running sequence uses it. True if it was present."""
        slot = self._slot_of.get(content_id)
        if slot is not None:
            if self._pins[slot]:
                raise AdapterFormatError("adapter_in_use", "the adapter is in use by running requests")
            del self._slot_of[content_id]
            self._owner[slot] = None
            self._clear_slot(slot)
            self._idle_slots.move_to_end(slot, last=False)
        self._failed.pop(content_id, None)
        return self._host.pop(content_id, None) is not None or slot is not None

    def _clear_slot(self, slot: int) -> None:
        if self.cpu is not None:
            self.cpu.evict(slot)

    # -- what a tensor-parallel rank changes (parallel/lora.py) ------------------------------------
    def _module_dims(self, model: ModelConfig) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection the slots hold: the model's own on one device."""
        return model.base_dims().module_dims()

    def _local_part(self, arrays: LoraArrays) -> LoraArrays:
        """The part of a validated adapter this process's slots hold: all of it on one device."""
        return arrays

    # -- views ---------------------------------------------------------------------------------
    def is_host_resident(self, content_id: str) -> bool:
        return content_id in self._host

    def is_loading(self, content_id: str) -> bool:
        return content_id in self._loading

    def resident(self) -> list[LoraWeights]:
        return list(self._host.values())

    def slot_owners(self) -> list[str | None]:
        return list(self._owner)

    @property
    def num_host_resident(self) -> int:
        return len(self._host)

    @property
    def num_slots_used(self) -> int:
        return sum(o is not None for o in self._owner)

    @property
    def num_pinned(self) -> int:
        return sum(p > 0 for p in self._pins)

    def check_integrity(self, running: list[Sequence]) -> None:
        pins = [0] * len(self._pins)
        for seq in running:
            if seq.adapter is not None:
                pins[self._slot_of[seq.adapter.content_id]] += 1
        assert pins == self._pins, (pins, self._pins)
        assert set(self._idle_slots) == {i for i, p in enumerate(self._pins) if p == 0}
        for cid, slot in self._slot_of.items():
            assert self._owner[slot] == cid
        if self.cpu is not None:
            self.cpu.check_integrity()

    def shutdown(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
