"""The block allocator hands out runs of consecutive ids (scheduler/block_pool.py)."""

import random

from tandem.scheduler.block_pool import BlockPool
from tandem.scheduler.kv_cache_manager import KVCacheManager
from tandem.scheduler.request import Request
from tandem.wire.engine_protocol import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def num_runs(block_ids):
    return sum(1 for i, b in enumerate(block_ids) if i == 0 or b != block_ids[i - 1] + 1)


def cache(pool, blocks, tag):
    for b in blocks:
        assert pool.cache_block(b, f"{tag}-{b.block_id}".encode())


def test_fresh_pool_runs_and_growth_continues_the_run():
    pool = BlockPool(16)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [0, 1, 2] and ids(b) == [3, 4]
    # a's successor (3) is taken: growth falls back to the lowest free run
    assert ids(pool.get_new_blocks(1, after=a[-1])) == [5]
    # b's successor is free: growth continues b's run, then the lowest free ids
    pool.free_blocks(reversed(a))
    grown = pool.get_new_blocks(3, after=b[-1])
    assert ids(grown) == [0, 1, 2]  # 5 is gone, so the lowest run (a's old blocks)
    c = pool.get_new_blocks(2, after=grown[-1])
    assert ids(c) == [6, 7]


def test_uncached_free_blocks_go_before_any_cached_block_is_evicted():
    pool = BlockPool(8)
    a = pool.get_new_blocks(4)
    cache(pool, a, "a")
    pool.free_blocks(reversed(a))  # 0-3 cached and free; 4-7 never used
    got = pool.get_new_blocks(4)
    assert ids(got) == [4, 5, 6, 7]
    assert len(pool.cached) == 4  # nothing evicted
    pool.free_blocks(got)  # uncached again: lowest uncached ids first, as one run
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert len(pool.cached) == 4


def test_strict_mode_evicts_cached_blocks_in_lru_order():
    pool = BlockPool(6, evict_runs=False)
    blocks = pool.get_new_blocks(6)
    cache(pool, blocks, "x")
    for b in [blocks[4], blocks[1], blocks[5], blocks[0], blocks[3], blocks[2]]:
        pool.free_blocks([b])  # LRU order 4 1 5 0 3 2
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 4, 5]  # the 3 least recently freed, sorted by id
    assert sorted(int(h.decode().split("-")[1]) for h in pool.cached) == [0, 2, 3]


def test_run_eviction_takes_old_neighbours_never_recently_freed_ones():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(8)
    cache(pool, blocks, "x")
    # one free call per block: ticks follow this order (oldest first)
    for i in [2, 6, 1, 3, 7, 0, 5, 4]:
        pool.free_blocks([blocks[i]])
    # head is 2 (tick 1); the older half is ticks <= 1 + (8 - 1) // 2 = 4: blocks 2 6 1 3.
    # Its neighbours 1 and 3 are old; 0 and 4 are recent and stay cached.
    got = pool.get_new_blocks(4)
    assert ids(got)[:3] == [1, 2, 3]
    assert 0 not in ids(got) and 4 not in ids(got) and 5 not in ids(got)
    # the LRU head (2) always goes first, and the 4th block is the next head (6)
    assert ids(got) == [1, 2, 3, 6]
    kept = sorted(int(h.decode().split("-")[1]) for h in pool.cached)
    assert kept == [0, 4, 5, 7]


def test_prefix_hit_still_revives_a_cached_free_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    kv.free(a)
    b = Request("b", list(range(8)) + [90, 91, 92], SamplingParams(max_tokens=4))
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and n == 8
    assert kv.allocate_slots(b, 3, n, hits) == [3]  # the uncached block after its hits
    assert kv.get_block_ids("b") == [0, 1, 3]
    kv.check_integrity()
    kv.free(b)
    kv.check_integrity()


def churn(evict_runs: bool, seed: int, steps: int = 400) -> float:
    """Random prompts allocated, grown and freed out of order; mean runs per
    prompt allocation once the pool has churned. Checks integrity throughout."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=96, block_size=4)
    kv.pool.evict_runs = evict_runs
    live: dict[str, Request] = {}
    runs, allocs, n = [], 0, 0
    for _ in range(steps):
        if live and (rng.random() < 0.45 or kv.num_free_blocks < 12):
            rid = rng.choice(sorted(live))
            kv.free(live.pop(rid))
        else:
            n += 1
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(9, 40))]
            r = Request(f"r{n}", prompt, SamplingParams(max_tokens=8))
            new = kv.allocate_slots(r, len(prompt))
            if new is None:
                continue
            r.num_computed_tokens = len(prompt)
            live[r.request_id] = r
            allocs += 1
            if allocs > 20:
                runs.append(num_runs(new))
        for r in list(live.values()):  # decode growth, interleaved
            if rng.random() < 0.5 and kv.allocate_slots(r, 1) is not None:
                r.append_output_token(7)
                r.num_computed_tokens += 1
        kv.check_integrity()
    for r in live.values():
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 96  # no leaks
    return sum(runs) / len(runs)


def test_churn_keeps_integrity_and_run_eviction_fragments_less():
    strict = [churn(False, s) for s in range(3)]
    runs = [churn(True, s) for s in range(3)]
    assert sum(runs) < 0.8 * sum(strict), (runs, strict)


def test_stale_heap_entries_stay_bounded():
    pool = BlockPool(8)
    for _ in range(200):
        # taking 0.. as a growth run leaves their heap entries stale; freeing
        # pushes them again, so without compaction the heap would grow
        (first,) = pool.get_new_blocks(1)
        rest = pool.get_new_blocks(7, after=first)
        assert ids([first] + rest) == list(range(8))
        pool.free_blocks(reversed([first] + rest))
        pool.check_integrity({})
    assert len(pool._uncached_ids) <= 2 * 8 + 64 + 8


def test_run_eviction_spares_an_old_neighbour_a_prefix_hit_shared():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(8)
    cache(pool, blocks, "x")
    pool.touch([blocks[1]])  # a second request's prefix hit shares block 1
    for i in [2, 6, 1, 3, 7, 0, 5, 4]:  # same ticks as the test above
        pool.free_blocks([blocks[i]] * (2 if i == 1 else 1))
    # without the hit, 1 would go with the head 2 (test above); now it stays
    got = pool.get_new_blocks(3)
    assert ids(got) == [2, 3, 6]  # head 2 with its old neighbour 3, then the next head 6
    assert pool.get_cached_block(b"x-1") is blocks[1]
    # handing a block out clears its mark: only a later hit sets it again
    assert not any(b.was_hit for b in got)
    pool.check_integrity({2: 1, 3: 1, 6: 1})


def test_prefix_eviction_benchmark_workload_runs_in_both_modes():
    from benchmarks.prefix_eviction import simulate, workload

    reqs = workload(seed=0, num_requests=40)
    assert len(reqs) == 40 and all(1 <= len(p) <= 1536 + 256 and m >= 8 for p, m in reqs)
    for evict_runs in (False, True):
        res = simulate(reqs, num_blocks=256, evict_runs=evict_runs)
        assert 0.0 < res["hit_rate"] < 1.0
        assert 0.0 < res["runs_per_block"] <= 1.0 and res["runs_per_request"] >= 1.0
