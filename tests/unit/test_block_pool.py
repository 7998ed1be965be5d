import pytest

from tandem.scheduler.block_pool import BlockPool, FreeBlockQueue, KVBlock
from tandem.scheduler.kv_cache_manager import KVCacheManager
from tandem.scheduler.request import Request
from tandem.wire.engine_protocol import SamplingParams


def req(rid, tokens, salt=None):
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def test_free_queue_order_and_remove():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 2]
    assert q.num_free_blocks == 3
    with pytest.raises(ValueError):
        q.remove(blocks[0])


def test_new_blocks_come_in_id_order_and_free_appends_lru():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1]
    pool.free_blocks(reversed(a))
    assert [b.block_id for b in pool.free_queue] == [2, 3, 1, 0]
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_double_free_detected():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(AssertionError):
        pool.free_blocks([b])


def test_prefix_hit_exact_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    # identical prompt: 2 full blocks hit (8 tokens); the partial block never hits
    b = req("b", list(range(10)))
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    # prompt of exactly 2 blocks: full hit drops the last block (1 token must compute)
    c = req("c", list(range(8)))
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0] and n == 4
    # different first block: miss everything (chained hash)
    d = req("d", [99] + list(range(1, 10)))
    assert kv.get_computed_blocks(d) == ([], 0)
    # cache salt isolates tenants
    e = req("e", list(range(10)), salt="tenant-2")
    assert kv.get_computed_blocks(e) == ([], 0)
    kv.free(a)
    kv.check_integrity()


def test_allocate_with_hit_takes_refs_and_eviction_prefers_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)  # blocks 0, 1 (both full -> cached)
    kv.free(a)  # free queue: 2 3 4 5 1 0
    assert [b.block_id for b in kv.pool.free_queue] == [2, 3, 4, 5, 1, 0]
    b = req("b", list(range(8)) + [50, 51])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 2, n, hits) == [2]
    assert kv.get_block_ids("b") == [0, 1, 2]
    assert kv.pool.blocks[0].ref_cnt == 1
    # a request needing every remaining free block evicts nothing cached in use
    c = req("c", list(range(100, 112)))
    assert kv.allocate_slots(c, 12) == [3, 4, 5]
    assert kv.allocate_slots(req("d", [1, 2]), 2) is None
    assert "d" not in kv.req_blocks
    kv.free(b)
    kv.free(c)
    kv.check_integrity()
    assert kv.num_free_blocks == 6


def test_eviction_drops_hash():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = req("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    kv.free(a)
    assert len(kv.pool.cached) == 2
    b = req("b", [9, 9, 9, 9])
    kv.allocate_slots(b, 4)  # evicts both cached blocks
    assert kv.get_computed_blocks(req("x", [1, 2, 3, 4, 5])) == ([], 0)
    kv.free(b)
    kv.check_integrity()


def test_hit_on_free_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    kv.free(a)  # 3 free, 2 of them cached
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    # needs 4 blocks in total: 2 revived + 2 new, but only 1 other is free
    assert kv.allocate_slots(b, 4, n, hits) is None
    kv.check_integrity()


def test_delay_cache_blocks_then_cache():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 4, delay_cache_blocks=True)
    assert kv.get_computed_blocks(req("x", [1, 2, 3, 4, 5])) == ([], 0)
    kv.cache_blocks(a, 4)
    hits, n = kv.get_computed_blocks(req("y", [1, 2, 3, 4, 5]))
    assert n == 4 and [h.block_id for h in hits] == [0, 1]
    kv.free(a)
    kv.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(req("b", [1, 2, 3])) == ([], 0)
