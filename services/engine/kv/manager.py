"""Per-request block tables over the block pool, with prefix caching by chained block hashes, prompt
forks with copy-on-write, and swapping to a host tier.

A block's hash chains its parent's hash, the request's cache extra (tenant cache salt, adapter
content id) and its token ids, so equal tokens under another tenant or another adapter never match.

A block is written in place only while exactly one table holds it and it is not in the prefix cache;
the first write into a shared or cached block copies it (copy-on-write). Copies and swaps are not
done here: they are queued as `BlockCopy`s, which the scheduler puts in the step plan and the model
runner executes before the forward.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

from services.engine.kv.block_pool import BlockKey, BlockPool
from services.engine.kv.copies import BlockCopy, CopyKind
from services.engine.kv.host_pool import HostBlockPool


class KVRequest(Protocol):
    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def cache_extra(self) -> tuple: ...


FROM_HOST = -1  # PrefixHit.block_ids entry of a block that comes back from the host tier


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The KV a request starts from: `num_tokens` tokens in `block_ids`, device blocks its table shares
    (prefix-cache hits, a fork's source blocks). For a swapped-out request (`kind` "swap"), entries equal
    to FROM_HOST are fresh blocks filled from `host_ids` at the same index."""

    block_ids: tuple[int, ...]
    num_tokens: int
    kind: str = "cache"  # cache | fork | swap
    host_ids: tuple[int, ...] = ()


NO_HIT = PrefixHit((), 0)


class SwappedBlock(NamedTuple):
    host: int | None  # its copy in the host tier, or None: a shared cached block, found again by its key
    cached: tuple[bytes, BlockKey] | None  # its prefix-cache entry when it was swapped out


@dataclass(slots=True)
class Swapped:
    blocks: list[SwappedBlock]
    num_tokens: int  # computed tokens when it was swapped out


@dataclass(frozen=True, slots=True)
class SwapEstimate:
    """What swapping a request out (and later back in) would move, against what recomputing it would
    compute: the input of the preemption cost model."""

    num_tokens: int  # computed tokens now
    copy_blocks: int  # blocks copied to the host tier (and back)
    recompute_tokens: int  # tokens a recompute computes again (shared cached leading blocks will hit)
    host_room: bool  # the host tier has copy_blocks free


def block_hash(key: BlockKey) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(key.parent or b"\0")
    h.update(repr(key.extra).encode())
    h.update(array("q", key.tokens).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True,
                 host: HostBlockPool | None = None):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.host = host if host is not None and host.num_blocks > 0 else None
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[tuple[bytes, BlockKey]]] = {}
        self._num_committed: dict[str, int] = {}
        self._swapped: dict[str, Swapped] = {}
        self._copies: list[BlockCopy] = []  # queued for the step plan being built (take_copies)
        self.num_cow_copies = 0
        self.num_swap_shared_blocks = 0  # blocks a swap-out left on the device (shared, cached)
        self.num_restore_misses = 0  # restores cut short: a left-behind block had left the cache

    # -- queries -------------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    @property
    def swapped_request_ids(self) -> set[str]:
        return set(self._swapped)

    def blocks_needed(self, req: KVRequest, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """Free blocks an `allocate` with these arguments takes (new blocks, blocks back from the host,
        a copy-on-write copy, and idle cached blocks a hit pulls off the free list)."""
        table = self._tables.get(req.request_id)
        if table is None:
            ids, computed = list(hit.block_ids), hit.num_tokens
            need = sum(1 for b in ids if b == FROM_HOST)
            need += sum(1 for b in ids if b != FROM_HOST and self.pool.blocks[b].ref_cnt == 0)
            cow = self._needs_cow(ids, computed, acquired=True)
        else:
            ids, computed, need = table, req.num_computed_tokens, 0
            cow = self._needs_cow(ids, computed, acquired=False)
        return need + cow + max(0, -(-(computed + num_new_tokens) // self.block_size) - len(ids))

    def _needs_cow(self, table: list[int], num_computed: int, acquired: bool) -> bool:
        """The next token is written into a block that another table shares or the prefix cache holds."""
        j = num_computed // self.block_size
        if j >= len(table) or table[j] == FROM_HOST:
            return False
        block = self.pool.blocks[table[j]]
        return block.ref_cnt + acquired > 1 or block.hash is not None

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

        On the first allocation the hit's blocks are shared (a prefix hit, a fork) or copied back from
        the host tier (a swapped-out request). When the next token goes into a block that is shared or
        cached, that block is copied first (copy-on-write). Returns False, changing nothing, when the
        pool is short.
        """
        rid = req.request_id
        first = rid not in self._tables
        if self.blocks_needed(req, num_new_tokens, hit if first else NO_HIT) > self.pool.num_free:
            return False
        if first:
            self._tables[rid] = self._start(req, hit)
        table = self._tables[rid]
        computed = hit.num_tokens if first else req.num_computed_tokens
        if self._needs_cow(table, computed, acquired=False):
            j = computed // self.block_size
            (copy,) = self.pool.allocate(1)
            self._copies.append(BlockCopy(CopyKind.COW, table[j], copy))
            self.pool.release([table[j]])
            table[j] = copy
            self.num_cow_copies += 1
        need = -(-(computed + num_new_tokens) // self.block_size) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def _start(self, req: KVRequest, hit: PrefixHit) -> list[int]:
        """The first table of a request: shared blocks acquired, swapped-out blocks copied back."""
        rid = req.request_id
        table = list(hit.block_ids)
        for b in table:  # shared blocks first: allocating could otherwise evict an idle one of them
            if b != FROM_HOST:
                self.pool.acquire(b)
        for j, b in enumerate(table):
            if b == FROM_HOST:
                (table[j],) = self.pool.allocate(1)
                self._copies.append(BlockCopy(CopyKind.SWAP_IN, hit.host_ids[j], table[j]))
        swapped = self._swapped.pop(rid, None)
        if swapped is not None:  # its host blocks are free once the copies above have read them
            self.host.release([e.host for e in swapped.blocks if e.host is not None])
            self.num_restore_misses += hit.kind == "swap" and len(hit.block_ids) < len(swapped.blocks)
        full = hit.num_tokens // self.block_size
        if hit.kind == "cache":
            self._num_committed[rid] = len(table)
        else:
            # A fork's or a restored request's full blocks go (back) into the prefix cache unless an
            # identical block is there already (the common case: they share or re-found it).
            self._num_committed[rid] = 0
            self._tables[rid] = table
            self._commit_blocks(req, full)
        return table

    def commit(self, req: KVRequest) -> None:
        """Publish the request's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._commit_blocks(req, req.num_computed_tokens // self.block_size)

    def _commit_blocks(self, req: KVRequest, full: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        done = self._num_committed.get(rid, 0)
        if full <= done:
            return
        table = self._tables[rid]
        for j, (h, key) in enumerate(self._block_hashes(req, full)[done:full], start=done):
            if self.pool.blocks[table[j]].hash is None:
                self.pool.mark_cached(table[j], h, key)
        self._num_committed[rid] = full

    def free(self, request_id: str) -> None:
        """Release every block the request holds, on the device and in the host tier (finish, abort or
        preemption by recompute)."""
        table = self._tables.pop(request_id, None)
        self._num_committed.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if table:
            self.pool.release(table)
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            self.host.release([e.host for e in swapped.blocks if e.host is not None])

    def truncate(self, req: KVRequest) -> None:
        """Release the blocks past those holding the request's computed tokens: the blocks a speculative
        draft took for tokens that were rejected (their slots inside a kept block are simply written again).
        Blocks past the computed tokens are never shared or cached: only full computed blocks are published,
        and a fork shares only computed ones."""
        table = self._tables.get(req.request_id)
        if not table:
            return
        keep = -(-req.num_computed_tokens // self.block_size)
        if len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            assert all(self.pool.blocks[b].ref_cnt == 1 and self.pool.blocks[b].hash is None for b in extra)
            self.pool.release(extra)

    # -- forks ---------------------------------------------------------------------------------
    def fork(self, source: KVRequest, num_tokens: int) -> PrefixHit:
        """A hit sharing the blocks that hold `source`'s first `num_tokens` tokens, partial last block
        included; `allocate` takes the references, and the first write into the shared partial block
        copies it."""
        assert source.num_computed_tokens >= num_tokens
        table = self._tables[source.request_id]
        return PrefixHit(tuple(table[: -(-num_tokens // self.block_size)]), num_tokens, "fork")

    # -- the host tier -------------------------------------------------------------------------
    def swap_estimate(self, req: KVRequest) -> SwapEstimate:
        """What `swap_out` would copy now. Only blocks this request alone holds, or that nobody can
        find again (shared but not in the prefix cache: a fork's partial block), need to move; blocks
        it shares that the prefix cache holds stay where they are, released, and are found again by
        their key on swap-in (a recompute would hit them too)."""
        table = self._tables[req.request_id]
        copy, leading_shared = 0, 0
        for j in range(-(-req.num_computed_tokens // self.block_size)):
            if self._stays_on_device(table[j]):
                leading_shared += leading_shared == j
            else:
                copy += 1
        return SwapEstimate(
            num_tokens=req.num_computed_tokens,
            copy_blocks=copy,
            recompute_tokens=max(0, req.num_computed_tokens - leading_shared * self.block_size),
            host_room=self.host is not None and copy <= self.host.num_free,
        )

    def _stays_on_device(self, block_id: int) -> bool:
        block = self.pool.blocks[block_id]
        return block.ref_cnt > 1 and block.hash is not None

    def swap_out(self, req: KVRequest) -> None:
        """Move the request's computed KV off the device: copies of its blocks to the host tier
        (queued), every device block released. The request then holds host blocks only, so a waiting
        request never pins device memory. Callers check `swap_estimate(req).host_room` first."""
        rid = req.request_id
        table = self._tables.pop(rid)
        entries = []
        for j in range(-(-req.num_computed_tokens // self.block_size)):
            block = self.pool.blocks[table[j]]
            cached = (block.hash, block.key) if block.hash is not None else None
            if self._stays_on_device(table[j]):
                entries.append(SwappedBlock(None, cached))
                self.num_swap_shared_blocks += 1
            else:
                host = self.host.allocate()
                self._copies.append(BlockCopy(CopyKind.SWAP_OUT, table[j], host))
                entries.append(SwappedBlock(host, cached))
        self.pool.release(table)  # after the copies are queued: the blocks may be handed out at once
        self._num_committed.pop(rid, None)
        self._swapped[rid] = Swapped(entries, req.num_computed_tokens)

    def restore(self, req: KVRequest) -> PrefixHit:
        """The hit that brings a swapped-out request back: blocks still in the prefix cache are shared
        again (no copy), the others come back from the host tier. A released shared block that left the
        cache meanwhile ends the hit there: the rest is recomputed (and its host blocks are freed)."""
        swapped = self._swapped[req.request_id]
        ids: list[int] = []
        hosts: list[int] = []
        full = swapped.num_tokens // self.block_size
        keys = self._block_hashes(req, full) if self.enable_prefix_caching else []
        for j, entry in enumerate(swapped.blocks):
            # A full block is looked up by its key even if it was not cached itself (an identical block
            # was): whatever holds the same tokens' KV needs no copy.
            cached = self.pool.lookup(*keys[j]) if j < full and keys else None
            if cached is not None:
                ids.append(cached)
                hosts.append(-1)
            elif entry.host is not None:
                ids.append(FROM_HOST)
                hosts.append(entry.host)
            else:
                break
        tokens = swapped.num_tokens if len(ids) == len(swapped.blocks) else len(ids) * self.block_size
        return PrefixHit(tuple(ids), tokens, "swap", tuple(hosts))

    def take_copies(self) -> list[BlockCopy]:
        """The block copies queued since the last call, in the order they must run."""
        copies, self._copies = self._copies, []
        return copies

    # -- checks --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a table lists a block twice"
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(refs)
        assert not set(self._tables) & set(self._swapped), "a request is both on the device and swapped out"
        hosts = [e.host for s in self._swapped.values() for e in s.blocks if e.host is not None]
        if self.host is not None:
            self.host.check_integrity(hosts)
        else:
            assert not hosts
        for s in self._swapped.values():
            assert len(s.blocks) == -(-s.num_tokens // self.block_size)
            assert all(e.host is not None or e.cached is not None for e in s.blocks)
        # Copy-on-write: a block two tables hold, or the prefix cache holds, is never the one a table
        # writes next -- checked where tables are written (allocate); here, every cached block is full
        # and read-only by construction (only commit publishes, and only full computed blocks).
