"""The KV block pool: fixed-size blocks, a free list in LRU order, ref counts, and the prefix-cache index.

A block whose ref count drops to zero goes to the free list but keeps its cache entry, so a later
request with the same prefix can take it back; allocation evicts from the least recently freed end.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; callers check `num_free` first."""


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Everything that makes a cached block reusable: verified on every hit, not just its hash."""

    parent: bytes | None
    extra: tuple  # (cache salt, adapter content id)
    tokens: tuple[int, ...]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None
    key: BlockKey | None = None


@dataclass(slots=True)
class BlockPool:
    num_blocks: int
    blocks: list[Block] = field(init=False)
    _free: OrderedDict[int, None] = field(init=False)
    _cached: dict[bytes, int] = field(init=False)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                del self._cached[block.hash]
                block.hash = block.key = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: bytes, key: BlockKey) -> int | None:
        """A cached block with exactly this key, or None (a hash collision is a miss)."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].key != key:
            return None
        return block_id

    def acquire(self, block_id: int) -> None:
        """Take a reference on a cached block (a prefix hit), pulling it off the free list if idle."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference each. Blocks are given in sequence order; later blocks are evicted first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)  # uncached blocks are reused first

    def mark_cached(self, block_id: int, block_hash: bytes, key: BlockKey) -> None:
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.hash is None
        if block_hash in self._cached:
            return  # an identical block is already cached; this one stays private
        block.hash, block.key = block_hash, key
        self._cached[block_hash] = block_id

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert the pool's invariants; with `expected_refs`, also that ref counts match the owners' tables."""
        free = set(self._free)
        assert len(free) == len(self._free)
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in free), block
            if block.hash is not None:
                assert self._cached.get(block.hash) == block.block_id, block
        assert all(self.blocks[b].hash == h for h, b in self._cached.items())
        if expected_refs is not None:
            for block in self.blocks:
                assert block.ref_cnt == expected_refs.get(block.block_id, 0), (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != owners {expected_refs.get(block.block_id, 0)}"
                )
