"""The command rank 0 sends every tensor-parallel rank: a fixed 8-int header and one packed int64 body.

A step's body holds what the other ranks need to compute the same step on their shards: per sequence its
start, new tokens, whether it samples, its adapter slot and block table (ragged), the step's token ids, and
the slot changes since the last command (parallel/lora.py). Block copies (swap, copy-on-write) travel the
same way: every rank owns the KV of its own heads under the same block ids. The channel (runner.py) sends a
body of up to INLINE words in the header's broadcast, a longer one in a second broadcast.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from services.engine.kv.copies import BlockCopy, CopyKind
from services.engine.parallel.lora import SlotEvent, decode_events, encode_events
from services.engine.scheduler import StepPlan

HEADER = 8
INLINE = 2048  # words of body sent with the header (16 KiB): a decode step of ~100 sequences
_KINDS = list(CopyKind)


class Command(enum.IntEnum):
    STEP = 1
    COPY = 2
    STOP = 3


@dataclass(frozen=True, slots=True)
class Row:
    """A ScheduledSeq as the model runner reads it, without its Sequence (prepare takes the token ids)."""

    start: int
    num_new_tokens: int
    block_table: tuple[int, ...]
    lora_slot: int
    samples: bool
    draft: tuple[int, ...] = ()  # always empty: TP refuses speculative decoding (EngineConfig)


@dataclass(slots=True)
class RowPlan:
    scheduled: list[Row] = field(default_factory=list)


@dataclass(slots=True)
class Received:
    command: Command
    events: list[SlotEvent]
    plan: RowPlan | None = None
    token_ids: list[int] | None = None
    copies: list[BlockCopy] | None = None


def _bytes_to_int64(data: bytes) -> np.ndarray:
    pad = -len(data) % 8
    return np.frombuffer(data + b"\0" * pad, dtype=np.int64)


def pack_step(plan: StepPlan, events: list[SlotEvent]) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, body) of a step. One list per field, so the body is built by a few list extends."""
    sched = plan.scheduled
    ev = encode_events(events)
    ids: list[int] = []
    tables: list[int] = []
    for s in sched:
        ids.extend(s.seq.token_ids[s.start : s.start + s.num_new_tokens])
        tables.extend(s.block_table)
    body = np.concatenate([
        np.array([s.start for s in sched], np.int64), np.array([s.num_new_tokens for s in sched], np.int64),
        np.array([s.samples for s in sched], np.int64), np.array([s.lora_slot for s in sched], np.int64),
        np.array([len(s.block_table) for s in sched], np.int64), np.array(tables, np.int64),
        np.array(ids, np.int64), _bytes_to_int64(ev),
    ])
    header = torch.tensor([Command.STEP, body.size, len(ev), len(sched), len(ids), len(tables), 0, 0], dtype=torch.int64)
    return header, torch.from_numpy(body)


def pack_copies(copies: list[BlockCopy], events: list[SlotEvent]) -> tuple[torch.Tensor, torch.Tensor]:
    ev = encode_events(events)
    body = np.concatenate([np.array([[_KINDS.index(c.kind), c.src, c.dst] for c in copies], np.int64).reshape(-1),
                           _bytes_to_int64(ev)])
    header = torch.tensor([Command.COPY, body.size, len(ev), len(copies), 0, 0, 0, 0], dtype=torch.int64)
    return header, torch.from_numpy(body)


def stop_header() -> torch.Tensor:
    return torch.tensor([Command.STOP, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int64)


def unpack(header: torch.Tensor, body: torch.Tensor | None) -> Received:
    cmd, size, n_ev, a, b, c, _, _ = header.tolist()
    command = Command(cmd)
    if command is Command.STOP:
        return Received(command, [])
    arr = body.numpy()
    ev_words = -(-n_ev // 8)
    events = decode_events(arr[size - ev_words :].tobytes()[:n_ev]) if n_ev else []
    if command is Command.COPY:
        trip = arr[: 3 * a].reshape(a, 3).tolist()
        return Received(command, events, copies=[BlockCopy(_KINDS[k], s, d) for k, s, d in trip])
    n, n_ids, n_tab = a, b, c
    starts, lens, samples, slots, tlens = (arr[i * n : (i + 1) * n].tolist() for i in range(5))
    flat = arr[5 * n : 5 * n + n_tab].tolist()
    ids = arr[5 * n + n_tab : 5 * n + n_tab + n_ids].tolist()
    rows, at = [], 0
    for i in range(n):
        rows.append(Row(starts[i], lens[i], tuple(flat[at : at + tlens[i]]), slots[i], bool(samples[i])))
        at += tlens[i]
    return Received(command, events, RowPlan(rows), ids)
