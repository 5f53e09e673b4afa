"""Per-request block tables over the block pool, with prefix caching by chained block hashes.

A block's hash chains its parent's hash, the request's cache extra (tenant cache salt, adapter
content id) and its token ids, so equal tokens under another tenant or another adapter never match.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Protocol, Sequence

from services.engine.kv.block_pool import BlockKey, BlockPool


class KVRequest(Protocol):
    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def cache_extra(self) -> tuple: ...


@dataclass(frozen=True, slots=True)
class PrefixHit:
    block_ids: tuple[int, ...]
    num_tokens: int


NO_HIT = PrefixHit((), 0)


def block_hash(key: BlockKey) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(key.parent or b"\0")
    h.update(repr(key.extra).encode())
    h.update(array("q", key.tokens).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[tuple[bytes, BlockKey]]] = {}
        self._num_committed: dict[str, int] = {}

    # -- queries -------------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def blocks_needed(self, req: KVRequest, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        table = self._tables.get(req.request_id)
        if table is None:
            have, total = len(hit.block_ids), hit.num_tokens + num_new_tokens
        else:
            have, total = len(table), req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    # -- prefix cache --------------------------------------------------------------------------
    def _block_hashes(self, req: KVRequest, num_blocks: int) -> list[tuple[bytes, BlockKey]]:
        chain = self._hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        bs = self.block_size
        while len(chain) < num_blocks:
            j = len(chain)
            key = BlockKey(chain[-1][0] if chain else None, req.cache_extra, tuple(tokens[j * bs : (j + 1) * bs]))
            chain.append((block_hash(key), key))
        return chain

    def match_prefix(self, req: KVRequest) -> PrefixHit:
        """Longest run of cached full blocks; never the whole prompt (the last token must be computed)."""
        if not self.enable_prefix_caching:
            return NO_HIT
        max_blocks = (len(req.all_token_ids) - 1) // self.block_size
        hits: list[int] = []
        for h, key in self._block_hashes(req, max_blocks):
            block_id = self.pool.lookup(h, key)
            if block_id is None:
                break
            hits.append(block_id)
        return PrefixHit(tuple(hits), len(hits) * self.block_size)

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, req: KVRequest, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Make the request's table cover its computed tokens plus `num_new_tokens`.

        On the first allocation a prefix hit's blocks are shared. Returns False, changing nothing,
        when the pool is short.
        """
        rid = req.request_id
        first = rid not in self._tables
        need = self.blocks_needed(req, num_new_tokens, hit if first else NO_HIT)
        idle_hits = sum(1 for b in hit.block_ids if self.pool.blocks[b].ref_cnt == 0) if first else 0
        if need + idle_hits > self.pool.num_free:
            return False
        if first:
            for b in hit.block_ids:
                self.pool.acquire(b)
            self._tables[rid] = list(hit.block_ids)
            self._num_committed[rid] = len(hit.block_ids)
        if need:
            self._tables[rid].extend(self.pool.allocate(need))
        return True

    def commit(self, req: KVRequest) -> None:
        """Publish the request's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        full = req.num_computed_tokens // self.block_size
        done = self._num_committed.get(rid, 0)
        if full <= done:
            return
        table = self._tables[rid]
        for j, (h, key) in enumerate(self._block_hashes(req, full)[done:full], start=done):
            if self.pool.blocks[table[j]].hash is None:
                self.pool.mark_cached(table[j], h, key)
        self._num_committed[rid] = full

    def free(self, request_id: str) -> None:
        """Release every block the request holds (finish, abort or preemption)."""
        table = self._tables.pop(request_id, None)
        self._num_committed.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if table:
            self.pool.release(table)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a table lists a block twice"
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(refs)
