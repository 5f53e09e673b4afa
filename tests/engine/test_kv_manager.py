"""Prefix caching through the KV manager: chained hashes salted by tenant and keyed by adapter."""
from dataclasses import dataclass

from services.engine.kv.block_pool import BlockPool
from services.engine.kv.manager import KVCacheManager


@dataclass
class Req:
    request_id: str
    tokens: list[int]
    salt: str = ""
    adapter: str | None = None
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self):
        return self.tokens

    @property
    def cache_extra(self):
        return (self.salt, self.adapter)


def make_kv(num_blocks=16, block_size=4) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), block_size)


def run_prefill(kv: KVCacheManager, req: Req) -> int:
    hit = kv.match_prefix(req)
    assert kv.allocate(req, len(req.tokens) - hit.num_tokens, hit)
    req.num_computed_tokens = len(req.tokens)
    kv.commit(req)
    return hit.num_tokens


def test_same_prefix_hits_full_blocks_but_never_the_last_token():
    kv = make_kv()
    prompt = list(range(10))
    assert run_prefill(kv, Req("a", prompt)) == 0
    assert run_prefill(kv, Req("b", prompt)) == 8  # 2 full blocks; the 10th token must be computed
    exact = list(range(8))  # a prompt that is exactly 2 blocks can only reuse the first
    assert run_prefill(kv, Req("c", exact)) == 4
    kv.check_integrity()


def test_hits_survive_the_owner_finishing_and_shared_blocks_are_ref_counted():
    kv = make_kv()
    prompt = list(range(9))
    run_prefill(kv, Req("a", prompt))
    kv.free("a")
    kv.check_integrity()
    b = Req("b", prompt)
    assert run_prefill(kv, b) == 8
    c = Req("c", prompt)
    assert run_prefill(kv, c) == 8
    shared = kv.block_table("b")[:2]
    assert shared == kv.block_table("c")[:2]
    assert all(kv.pool.blocks[x].ref_cnt == 2 for x in shared)
    kv.check_integrity()
    kv.free("b")
    kv.free("c")
    assert kv.pool.num_used == 0
    kv.check_integrity()


def test_salt_and_adapter_partition_the_cache():
    kv = make_kv()
    prompt = list(range(12))
    run_prefill(kv, Req("a", prompt, salt="tenant-1", adapter="sha-A"))
    assert run_prefill(kv, Req("b", prompt, salt="tenant-2", adapter="sha-A")) == 0
    assert run_prefill(kv, Req("c", prompt, salt="tenant-1", adapter="sha-B")) == 0
    assert run_prefill(kv, Req("d", prompt, salt="tenant-1", adapter=None)) == 0
    assert run_prefill(kv, Req("e", prompt, salt="tenant-1", adapter="sha-A")) == 8


def test_divergent_suffix_hits_only_the_common_blocks():
    kv = make_kv()
    run_prefill(kv, Req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert run_prefill(kv, Req("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])) == 4


def test_allocate_refuses_without_changing_anything_when_short():
    kv = make_kv(num_blocks=3)
    a = Req("a", list(range(8)))
    assert kv.allocate(a, 8)
    big = Req("b", list(range(100, 108)))
    assert not kv.allocate(big, 8)
    assert kv.block_table("b") == [] and kv.pool.num_free == 1
    kv.check_integrity()


def test_idle_cached_hit_blocks_count_against_free_space():
    kv = make_kv(num_blocks=3)
    a = Req("a", list(range(9)))
    run_prefill(kv, a)
    kv.free("a")  # 3 blocks free, 2 of them cached
    b = Req("b", list(range(9)) + [50, 51, 52, 53])
    hit = kv.match_prefix(b)
    assert hit.num_tokens == 8
    # 13 tokens need 4 blocks: 2 from the hit + 2 new, but only 1 non-hit block is free.
    assert not kv.allocate(b, 5, hit)
    kv.check_integrity()
