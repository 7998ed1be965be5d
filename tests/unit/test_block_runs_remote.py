"""A decode engine shapes a request's new blocks after the prefill engine's
block-id runs (``BlockPool.get_new_blocks(runs=...)``), so a KV READ posts one
descriptor per run consecutive on both engines and no more."""

import random

import pytest

from scheduler.block_pool import BlockPool, _arrange, _num_segments
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.messages import SamplingParams
from scheduler.request import Request
from tests.unit.test_block_runs import free_all_and_check, grow_and_check, ids


def hold_all_but(pool, free_ids):
    """Take every block, then free ``free_ids`` (uncached) in that order."""
    blocks = pool.get_new_blocks(pool.num_blocks)
    pool.free_blocks([blocks[i] for i in free_ids])
    return [b for b in blocks if b.block_id not in free_ids]


def test_one_consecutive_run_when_a_hole_holds_them_all_exact_hole_first():
    pool = BlockPool(16)
    held = hold_all_but(pool, [1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13])
    got = pool.get_new_blocks(5, runs=[2, 3])
    assert ids(got) == [9, 10, 11, 12, 13]  # the exact hole, not the head of 1-6
    pool.free_blocks(got + held)
    pool.check_integrity({})


def test_runs_placed_in_holes_of_their_length_in_remote_order():
    pool = BlockPool(12)
    held = hold_all_but(pool, [1, 2, 5, 6, 7])  # holes of 2 and 3, none of 5
    got = pool.get_new_blocks(5, runs=[3, 2])
    assert ids(got) == [5, 6, 7, 1, 2]  # breaks only where the remote runs break
    assert _num_segments(got, [3, 2]) == 2
    pool.free_blocks(got + held)
    pool.check_integrity({})


def test_arrange_moves_local_breaks_onto_remote_ones():
    pool = BlockPool(10)
    blocks = {b.block_id: b for b in pool.get_new_blocks(10)}
    given = [blocks[i] for i in (0, 1, 2, 7, 8)]
    assert _num_segments(given, [2, 3]) == 3
    arranged = _arrange(given, [2, 3])
    assert ids(arranged) == [7, 8, 0, 1, 2] and _num_segments(arranged, [2, 3]) == 2
    # an order already as good is kept as it is
    assert _arrange(given, [3, 2]) is given


def test_runs_must_be_positive_and_add_up():
    pool = BlockPool(8)
    with pytest.raises(ValueError, match="runs"):
        pool.get_new_blocks(4, runs=[2, 1])
    with pytest.raises(ValueError, match="runs"):
        pool.get_new_blocks(2, runs=[3, -1])
    pool.check_integrity({})


def remote_runs(rng, n):
    runs, left = [], n
    while left:
        k = rng.randint(1, left)
        runs.append(k)
        left -= k
    return runs


def churn(shaped: bool, seed: int, steps: int = 300) -> float:
    """Requests allocated with random remote runs (the decode side), grown and
    freed out of order, with cached and uncached blocks mixed; returns segments
    per block over the allocations after warm-up. Integrity throughout."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=96, block_size=4)
    live: dict[str, Request] = {}
    segments = blocks = allocs = n = 0
    for _ in range(steps):
        if live and (rng.random() < 0.45 or kv.num_free_blocks < 12):
            kv.free(live.pop(rng.choice(sorted(live))))
        else:
            n += 1
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(9, 40))]
            r = Request(f"r{n}", prompt, SamplingParams(max_tokens=8))
            num_blocks = -(-len(prompt) // 4)
            runs = remote_runs(rng, num_blocks)
            new = kv.allocate_slots(r, len(prompt), block_runs=runs if shaped else None)
            if new is None:
                continue
            assert len(new) == num_blocks
            r.num_computed_tokens = len(prompt)
            live[r.request_id] = r
            allocs += 1
            if allocs > 20:
                segments += _num_segments(kv.req_blocks[r.request_id], runs)
                blocks += num_blocks
        grow_and_check(kv, live, rng)
    free_all_and_check(kv, live)
    return segments / blocks


def test_shaped_allocation_keeps_integrity_and_posts_fewer_segments():
    shaped = [churn(True, s) for s in range(3)]
    plain = [churn(False, s) for s in range(3)]
    assert sum(shaped) < sum(plain), (shaped, plain)


def test_mismatched_runs_are_ignored_by_the_manager():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r = Request("r", list(range(12)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(r, 12, block_runs=[1, 1]) == [0, 1, 2]
    kv.free(r)
    kv.check_integrity()
