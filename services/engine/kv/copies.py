"""Block copies a step needs before its forward: swap-out (device -> host), swap-in (host -> device) and
copy-on-write (device -> device), as one list in the order the scheduler decided them.

One ordered list, not three unordered ones: within a step a block can be freed and handed out again
(a victim's swapped-out block becomes a swapped-in or copied-on-write block of another sequence, a
block that just received a copy is swapped out by a later preemption), so only the scheduler's order
says which copy reads a block before another one writes it. The runner batches runs of copies of one
kind that do not depend on each other (`copy_batches`), so the order costs nothing when nothing conflicts.
"""
from __future__ import annotations

import enum
from typing import NamedTuple


class CopyKind(enum.Enum):
    SWAP_OUT = "swap_out"  # device block -> host block
    SWAP_IN = "swap_in"  # host block -> device block
    COW = "cow"  # device block -> device block (the first write into a shared block)

    @property
    def src_tier(self) -> str:
        return "host" if self is CopyKind.SWAP_IN else "device"

    @property
    def dst_tier(self) -> str:
        return "host" if self is CopyKind.SWAP_OUT else "device"


class BlockCopy(NamedTuple):
    kind: CopyKind
    src: int
    dst: int


class CopyBatch(NamedTuple):
    kind: CopyKind
    src: list[int]
    dst: list[int]


def copy_batches(ops: list[BlockCopy]) -> list[CopyBatch]:
    """Split the ordered copies into batches that can each run as one gather/scatter per tensor and
    give the same result as running the copies one by one: a batch holds consecutive copies of one kind
    where no copy reads or writes a block an earlier copy of the batch wrote, or writes one it read."""
    batches: list[CopyBatch] = []
    read: set[tuple[str, int]] = set()
    written: set[tuple[str, int]] = set()
    for op in ops:
        src, dst = (op.kind.src_tier, op.src), (op.kind.dst_tier, op.dst)
        if not batches or batches[-1].kind is not op.kind or src in written or dst in written or dst in read:
            batches.append(CopyBatch(op.kind, [], []))
            read, written = set(), set()
        batches[-1].src.append(op.src)
        batches[-1].dst.append(op.dst)
        read.add(src)
        written.add(dst)
    return batches
