"""Block pool invariants: ref counts, LRU reuse of freed cached blocks, integrity under random use."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.kv.block_pool import BlockKey, BlockPool, NoFreeBlocks


def key(i: int) -> BlockKey:
    return BlockKey(None, ("salt", None), (i, i + 1))


def test_allocate_and_release_round_trip():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert pool.num_free == 1 and len(set(ids)) == 3
    pool.release(ids)
    assert pool.num_free == 4
    pool.check_integrity({})


def test_allocation_beyond_capacity_raises():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_freed_cached_block_is_found_until_evicted():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.mark_cached(b, b"h1", key(1))
    pool.release([b])
    assert pool.lookup(b"h1", key(1)) == b
    pool.acquire(b)  # a prefix hit takes it back off the free list
    assert pool.num_free == 2
    pool.release([b])
    # Uncached free blocks are reused before the cached one; the third allocation evicts it.
    pool.allocate(2)
    assert pool.lookup(b"h1", key(1)) == b
    pool.allocate(1)
    assert pool.lookup(b"h1", key(1)) is None
    pool.check_integrity()


def test_lookup_verifies_the_full_key_not_just_the_hash():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.mark_cached(b, b"h", key(1))
    assert pool.lookup(b"h", key(2)) is None  # same hash, different tokens: a collision is a miss
    assert pool.lookup(b"h", BlockKey(None, ("other-tenant", None), (1, 2))) is None


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.mark_cached(a, b"a", key(1))
    pool.mark_cached(b, b"b", key(2))
    pool.release([a])
    pool.release([b])
    pool.allocate(1)
    assert pool.lookup(b"a", key(1)) is None and pool.lookup(b"b", key(2)) == b


def test_double_free_is_caught():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(AssertionError):
        pool.release([b])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]), st.integers(0, 5)), max_size=60))
def test_random_operations_keep_integrity(ops):
    pool = BlockPool(8)
    owners: list[list[int]] = []
    cached: dict[bytes, BlockKey] = {}
    for op, n in ops:
        if op == "alloc" and n <= pool.num_free:
            owners.append(pool.allocate(n))
        elif op == "free" and owners:
            pool.release(owners.pop(n % len(owners)))
        elif op == "cache" and owners and owners[-1]:
            b = owners[-1][n % len(owners[-1])]
            if pool.blocks[b].hash is None:
                h = bytes([n, b])
                if h not in cached:
                    cached[h] = key(b * 10 + n)
                    pool.mark_cached(b, h, cached[h])
        elif op == "hit" and cached:
            h = sorted(cached)[n % len(cached)]
            b = pool.lookup(h, cached[h])
            if b is not None:
                pool.acquire(b)
                owners.append([b])
        refs: dict[int, int] = {}
        for table in owners:
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        pool.check_integrity(refs)
