"""Adapter slots under tensor parallelism: rank 0 decides, every rank holds its slice of the same slots.

Rank 0's manager is the engine's (queueing, host tier, loads, slot choice, pins) and records every change
to its device slots as a `SlotEvent`; the step command carries the events to the other ranks, which replay
them in order on their own slot tables before that step's forward: an install reads the adapter file
(the same checks as rank 0) and keeps this rank's slice of it (shard.py), so every rank's slot s holds a
slice of the same adapter, and the step's token->slot plan is shared as it is.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from services.engine.config import ModelConfig
from services.engine.lora.manager import AdapterManager
from services.engine.lora.weights import LoraArrays, LoraWeights
from services.engine.parallel.shard import TpShard
from services.engine.sequence import AdapterRef, Sequence

INSTALL, EVICT, ACTIVATE, DEACTIVATE = "install", "evict", "activate", "deactivate"


@dataclass(frozen=True, slots=True)
class SlotEvent:
    op: str
    slot: int
    content_id: str = ""
    name: str = ""
    path: str = ""  # a local directory every rank can read (a remote adapter's copy in the cache)


def encode_events(events: list[SlotEvent]) -> bytes:
    return json.dumps([asdict(e) for e in events]).encode() if events else b""


def decode_events(data: bytes) -> list[SlotEvent]:
    return [SlotEvent(**e) for e in json.loads(data)] if data else []


class TpAdapterManager(AdapterManager):
    """An AdapterManager whose slots hold this rank's slice of each adapter. On rank 0 it records its slot
    changes (`drain_events`); on the other ranks `replay` applies rank 0's."""

    def __init__(self, model: ModelConfig, config, *, shard: TpShard, **kw):
        self.shard = shard  # before the base constructor: it sizes the slots through _module_dims
        self.events: list[SlotEvent] = []
        self._sources: dict[str, str] = {}  # content id -> the local directory it was read from
        super().__init__(model, config, **kw)

    def _module_dims(self, model: ModelConfig) -> dict[str, tuple[int, int]]:
        return self.shard.module_dims(super()._module_dims(model))

    def _local_part(self, arrays: LoraArrays) -> LoraArrays:
        return self.shard.slice_lora(arrays)

    def _read(self, ref: AdapterRef) -> LoraWeights:
        self._sources[ref.content_id] = str(self._fetch(ref))
        return super()._read(ref)

    # -- rank 0: record ------------------------------------------------------------------------------
    def _write_slot(self, slot: int, weights: LoraWeights) -> None:
        super()._write_slot(slot, weights)
        self.events.append(SlotEvent(INSTALL, slot, weights.content_id, weights.name, self._sources[weights.content_id]))

    def _clear_slot(self, slot: int) -> None:
        super()._clear_slot(slot)
        self.events.append(SlotEvent(EVICT, slot))

    def _pin(self, slot: int) -> None:
        first = self._pins[slot] == 0
        super()._pin(slot)
        if first:
            self.events.append(SlotEvent(ACTIVATE, slot))

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        slot = self._slot_of[seq.adapter.content_id]
        if self._pins[slot] == 0:
            self.events.append(SlotEvent(DEACTIVATE, slot))

    def drain_events(self) -> list[SlotEvent]:
        events, self.events = self.events, []
        return events

    # -- ranks 1..N-1: replay ----------------------------------------------------------------------------
    def replay(self, events: list[SlotEvent]) -> None:
        """Apply rank 0's slot changes, in its order. An install that fails here after it passed on rank 0
        (the file changed underneath) raises: the ranks would disagree, so the engine must not go on."""
        for e in events:
            if e.op == INSTALL:
                weights = self._read(AdapterRef(e.content_id, e.name, e.path))
                super()._write_slot(e.slot, weights)
                self._owner[e.slot] = e.content_id
            elif e.op == EVICT:
                super()._clear_slot(e.slot)
                self._owner[e.slot] = None
            elif self.cpu is not None:
                (self.cpu.activate if e.op == ACTIVATE else self.cpu.deactivate)(e.slot)
