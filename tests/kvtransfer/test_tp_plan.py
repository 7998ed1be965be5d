"""Read plans across tensor-parallel sizes, checked byte for byte against an oracle.

For every (P TP, D TP) in {1, 2, 4}^2, every KV head count in {1, 2, 4, 8} and
both layouts: the model's full KV is split into P's shards and D's expected
shards with numpy; D's plan is executed as plain byte copies; every byte of
D's blocks must be written exactly once and equal D's expected shard.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tandem.kvtransfer.compat import BLOCKS_FIRST, HEAD_MAJOR, KV_LAYOUTS, RankLayout
from tandem.kvtransfer.tp_plan import (
    BlockGeometry,
    HeadRead,
    coalesce,
    plan_rank_reads,
    read_descriptors,
    shard_for,
)

TP_SIZES = (1, 2, 4)
KV_HEADS = (1, 2, 4, 8)
L, BS, D = 2, 3, 2  # layers, block size, head dim (float32)
NUM_BLOCKS = 6


def shard_bytes(full: np.ndarray, shard: RankLayout, layout: str) -> np.ndarray:
    """One rank's KV tensor ``[blocks, ...]`` in ``layout``, as raw bytes per block."""
    part = full[:, :, :, :, shard.head_start : shard.head_start + shard.num_heads, :]
    if layout == HEAD_MAJOR:
        part = part.transpose(0, 4, 1, 2, 3, 5)
    return np.ascontiguousarray(part).view(np.uint8).reshape(full.shape[0], -1)


def test_shard_for_splits_and_replicates():
    assert [shard_for(8, 4, r) for r in range(4)] == [
        RankLayout(4, r, 2 * r, 2, False) for r in range(4)
    ]
    # 2 heads on 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1
    assert [
        (s.head_start, s.num_heads, s.replicated)
        for s in map(lambda r: shard_for(2, 4, r), range(4))
    ] == [(0, 1, True), (0, 1, True), (1, 1, True), (1, 1, True)]
    with pytest.raises(
        ValueError, match="num_kv_heads=6 is not divisible by tensor_parallel_size=4"
    ):
        shard_for(6, 4, 0)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=6 is not a multiple of num_kv_heads=4"
    ):
        shard_for(4, 6, 0)
    with pytest.raises(ValueError, match="tp_rank must be in 0..1"):
        shard_for(4, 2, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        shard_for(4, 0, 0)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
def test_every_pairing_tiles_each_decode_shard_exactly_once(layout, num_kv_heads):
    rng = np.random.default_rng(num_kv_heads)
    geometry = BlockGeometry(layout, L, BS, D, 4)
    full = rng.standard_normal((NUM_BLOCKS, L, 2, BS, num_kv_heads, D)).astype(np.float32)
    remote_ids = [4, 5, 0, 2]  # P's blocks of the request
    local_ids = [1, 2, 3, 5]  # where D puts them (a run and a jump)
    for p_tp, d_tp in itertools.product(TP_SIZES, TP_SIZES):
        p_shards = [shard_for(num_kv_heads, p_tp, r) for r in range(p_tp)]
        p_bytes = [shard_bytes(full, s, layout).ravel() for s in p_shards]
        for d_rank in range(d_tp):
            d_shard = shard_for(num_kv_heads, d_tp, d_rank)
            block_len = geometry.block_len(d_shard.num_heads)
            got = np.zeros(NUM_BLOCKS * block_len, dtype=np.uint8)
            times_written = np.zeros(NUM_BLOCKS * block_len, dtype=np.int64)
            reads = plan_rank_reads(num_kv_heads, p_tp, d_tp, d_rank)
            num_bytes = 0
            for read in reads:
                src = p_shards[read.src_rank]
                descs = read_descriptors(geometry, d_shard, src, read, local_ids, remote_ids)
                for dst, srca, n in zip(descs.local_addrs, descs.remote_addrs, descs.lengths):
                    got[dst : dst + n] = p_bytes[read.src_rank][srca : srca + n]
                    times_written[dst : dst + n] += 1
                num_bytes += descs.num_bytes
            where = f"P TP {p_tp} -> D rank {d_rank}/{d_tp}, {num_kv_heads} heads, {layout}"
            expected = np.zeros((NUM_BLOCKS, block_len), dtype=np.uint8)
            expected[local_ids] = shard_bytes(full, d_shard, layout)[remote_ids]
            written = np.zeros((NUM_BLOCKS, block_len), dtype=np.int64)
            written[local_ids] = 1
            assert np.array_equal(times_written, written.ravel()), where
            assert np.array_equal(got, expected.ravel()), where
            assert num_bytes == len(local_ids) * block_len, where


@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
def test_each_head_is_read_once_from_a_rank_that_holds_it(num_kv_heads):
    for p_tp, d_tp in itertools.product(TP_SIZES, TP_SIZES):
        for d_rank in range(d_tp):
            mine = shard_for(num_kv_heads, d_tp, d_rank)
            reads = plan_rank_reads(num_kv_heads, p_tp, d_tp, d_rank)
            heads = [h for r in reads for h in range(r.head_start, r.head_start + r.num_heads)]
            assert heads == list(range(mine.head_start, mine.head_start + mine.num_heads))
            for read in reads:
                src = shard_for(num_kv_heads, p_tp, read.src_rank)
                assert src.head_start <= read.head_start
                assert read.head_start + read.num_heads <= src.head_start + src.num_heads
            if p_tp == d_tp:  # homogeneous: rank r reads its whole shard from rank r
                assert reads == [HeadRead(d_rank, mine.head_start, mine.num_heads)]


def test_replicated_heads_pick_the_canonical_or_matching_replica():
    # 1 head, P TP 2, D TP 1: D reads head 0 once, from P rank 0 (P1's copy is never read)
    assert plan_rank_reads(1, 2, 1, 0) == [HeadRead(0, 0, 1)]
    # 2 heads, P TP 4 (ranks 0,1 hold head 0; 2,3 head 1), D TP 1: canonical copies 0 and 2
    assert plan_rank_reads(2, 4, 1, 0) == [HeadRead(0, 0, 1), HeadRead(2, 1, 1)]
    # 1 head, P TP 2, D TP 4: D's four replicas spread over P's two (0, 1, 0, 1)
    assert [plan_rank_reads(1, 2, 4, d)[0].src_rank for d in range(4)] == [0, 1, 0, 1]
    # 2 heads, P TP 1, D TP 4: every D replica reads its head from the only P rank
    assert [plan_rank_reads(2, 1, 4, d) for d in range(4)] == [
        [HeadRead(0, 0, 1)],
        [HeadRead(0, 0, 1)],
        [HeadRead(0, 1, 1)],
        [HeadRead(0, 1, 1)],
    ]
    # 8 heads, P TP 4, D TP 2: each D rank assembles its 4 heads from two P ranks
    assert plan_rank_reads(8, 4, 2, 1) == [HeadRead(2, 4, 2), HeadRead(3, 6, 2)]


def test_descriptor_counts_per_layout():
    """Whole blocks merge into runs; a head slice is 1 piece per block head-major
    and L*2*bs pieces per block blocks-first."""
    heads = 4
    local_ids, remote_ids = [0, 1, 2, 7], [3, 4, 5, 9]  # runs: 3 blocks + 1 block
    for layout in KV_LAYOUTS:
        geometry = BlockGeometry(layout, L, BS, D, 4)
        whole = read_descriptors(
            geometry,
            shard_for(heads, 2, 1),
            shard_for(heads, 2, 1),
            plan_rank_reads(heads, 2, 2, 1)[0],
            local_ids,
            remote_ids,
        )
        assert len(whole) == 2 and list(whole.lengths) == [
            3 * geometry.block_len(2),
            geometry.block_len(2),
        ]
        half = read_descriptors(
            geometry,
            shard_for(heads, 2, 1),
            shard_for(heads, 1, 0),
            plan_rank_reads(heads, 1, 2, 1)[0],
            local_ids,
            remote_ids,
        )
        per_block = 1 if layout == HEAD_MAJOR else L * 2 * BS
        assert len(half) == 4 * per_block, layout
        assert half.num_bytes == 4 * geometry.block_len(2)


def test_coalesce_needs_both_sides_adjacent():
    lengths = np.array([4, 4, 4, 4])
    d = coalesce(np.array([0, 4, 8, 20]), np.array([100, 104, 200, 204]), lengths)
    assert (list(d.local_addrs), list(d.remote_addrs), list(d.lengths)) == (
        [0, 8, 20],
        [100, 200, 204],
        [8, 4, 4],
    )


def test_bad_reads_are_refused():
    geometry = BlockGeometry(BLOCKS_FIRST, L, BS, D, 4)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        BlockGeometry("layers_first", L, BS, D, 4)
    with pytest.raises(ValueError, match=r"heads \[2, 4\) are not all on the remote rank 0"):
        read_descriptors(
            geometry, shard_for(4, 2, 1), shard_for(4, 2, 0), HeadRead(0, 2, 2), [0], [0]
        )
    with pytest.raises(ValueError, match="1 local vs 2 remote block ids"):
        read_descriptors(
            geometry, shard_for(4, 1, 0), shard_for(4, 1, 0), HeadRead(0, 0, 4), [0], [0, 1]
        )
