"""The host-memory tier of the KV cache: block ids of a CPU tensor pool (owned by the model runner) with
their own free list. Swapped-out sequences hold host blocks; nothing here is shared or cached."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class HostBlockPool:
    num_blocks: int
    _free: list[int] = field(init=False)
    _used: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: low ids first
        self._used = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        assert self._free, "host tier is full; callers check num_free first"
        block = self._free.pop()
        self._used.add(block)
        return block

    def release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert b in self._used, f"double free of host block {b}"
            self._used.remove(b)
            self._free.append(b)

    def check_integrity(self, expected_used: list[int] | None = None) -> None:
        """Free and used partition the pool; with `expected_used` (every owner's host blocks), the used
        set is exactly those and no block has two owners."""
        free = set(self._free)
        assert len(free) == len(self._free), "a host block is twice on the free list"
        assert not free & self._used, "a host block is both free and used"
        assert len(free) + len(self._used) == self.num_blocks, "host blocks lost"
        if expected_used is not None:
            assert len(set(expected_used)) == len(expected_used), "a host block has two owners"
            assert set(expected_used) == self._used, f"host blocks used {sorted(self._used)} != owned {sorted(expected_used)}"
