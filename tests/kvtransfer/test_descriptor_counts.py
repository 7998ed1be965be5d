"""The connector posts the FEWEST descriptors that move a load correctly.

Oracle, independent of ``tp_plan``'s offset arithmetic: every element a
decode rank must receive is paired with its source element through numpy
index arrays of each shard's storage (``compat.STORAGE_ORDER``); sorted by
local address, the pairs form maximal chains adjacent on both sides, and no
set of (local, remote, length) copies can have fewer members than there are
chains. ``read_descriptors`` must give exactly that many, covering exactly
those pairs, for both layouts, every TP pairing, with contiguous and
fragmented block lists.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tandem.kvtransfer.compat import BLOCKS_FIRST, HEAD_MAJOR, KV_LAYOUTS, STORAGE_ORDER, RankLayout
from tandem.kvtransfer.tp_plan import BlockGeometry, plan_rank_reads, read_descriptors, shard_for

L, BS, D = 2, 3, 2  # layers, block size, head dim
ELEM = 4  # float32
NUM_BLOCKS = 12
TP_SIZES = (1, 2, 4)


def element_offsets(layout: str, shard: RankLayout) -> np.ndarray:
    """Byte offset of every element of a shard's KV, indexed like the logical
    ``[blk, L, 2, bs, heads held, d]`` tensor."""
    logical = (NUM_BLOCKS, L, 2, BS, shard.num_heads, D)
    order = STORAGE_ORDER[layout]
    storage = np.arange(np.prod(logical)).reshape([logical[i] for i in order])
    return storage.transpose(np.argsort(order)) * ELEM


def oracle_pairs(layout, local, remote, read, local_ids, remote_ids) -> np.ndarray:
    """``[n, 2]`` (local byte, remote byte) of every element the read moves,
    sorted by local byte."""
    heads = slice(read.head_start, read.head_start + read.num_heads)

    def pick(shard: RankLayout, ids: list[int]) -> np.ndarray:
        offsets = element_offsets(layout, shard)
        within = slice(heads.start - shard.head_start, heads.stop - shard.head_start)
        return offsets[ids][:, :, :, :, within, :].ravel()

    pairs = np.stack([pick(local, local_ids), pick(remote, remote_ids)], axis=1)
    return pairs[np.argsort(pairs[:, 0], kind="stable")]


def fewest_copies(pairs: np.ndarray) -> int:
    """Maximal chains of elements adjacent on both sides (local order)."""
    step = np.diff(pairs, axis=0)
    return 1 + int(np.count_nonzero((step[:, 0] != ELEM) | (step[:, 1] != ELEM)))


def expand(descs) -> np.ndarray:
    """The (local byte, remote byte) element pairs the descriptors copy."""
    chunks = [
        np.stack([np.arange(a, a + n, ELEM), np.arange(b, b + n, ELEM)], axis=1)
        for a, b, n in zip(descs.local_addrs, descs.remote_addrs, descs.lengths)
    ]
    pairs = np.concatenate(chunks)
    return pairs[np.argsort(pairs[:, 0], kind="stable")]


BLOCK_LISTS = {
    "contiguous": ([2, 3, 4, 5, 6], [6, 7, 8, 9, 10]),
    "fragmented": ([9, 1, 2, 5, 6, 11], [0, 4, 5, 2, 3, 8]),
    "runs out of order": ([3, 4, 0, 1, 2], [8, 9, 5, 6, 7]),  # one run once sorted
    "one block": ([7], [1]),
}


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("blocks", sorted(BLOCK_LISTS))
def test_descriptors_are_the_fewest_correct_copies(layout, blocks):
    local_ids, remote_ids = BLOCK_LISTS[blocks]
    geometry = BlockGeometry(layout, L, BS, D, ELEM)
    for num_kv_heads in (1, 2, 4, 8):
        for p_tp, d_tp in itertools.product(TP_SIZES, TP_SIZES):
            for d_rank in range(d_tp):
                local = shard_for(num_kv_heads, d_tp, d_rank)
                for read in plan_rank_reads(num_kv_heads, p_tp, d_tp, d_rank):
                    remote = shard_for(num_kv_heads, p_tp, read.src_rank)
                    descs = read_descriptors(geometry, local, remote, read, local_ids, remote_ids)
                    pairs = oracle_pairs(layout, local, remote, read, local_ids, remote_ids)
                    where = f"{num_kv_heads} heads, P TP {p_tp} -> D {d_rank}/{d_tp}, {read}"
                    assert np.array_equal(expand(descs), pairs), where
                    assert len(descs) == fewest_copies(pairs), where


def test_the_counts_this_gives():
    """What the minimum is for a 5-block load in two runs (local [0, 1, 2] and
    [7, 8]): whole blocks (same TP) one per run in either layout; a head slice
    one per block head-major, one per (layer, K/V, slot) per block blocks-first."""
    local_ids, remote_ids = [0, 1, 2, 7, 8], [3, 4, 5, 9, 10]
    counts = {}
    for layout in KV_LAYOUTS:
        geometry = BlockGeometry(layout, L, BS, D, ELEM)
        for p_tp, d_tp in ((2, 2), (1, 2), (2, 1)):
            local = shard_for(4, d_tp, 0)
            reads = plan_rank_reads(4, p_tp, d_tp, 0)
            counts[layout, p_tp, d_tp] = [
                len(
                    read_descriptors(
                        geometry,
                        local,
                        shard_for(4, p_tp, r.src_rank),
                        r,
                        local_ids,
                        remote_ids,
                    )
                )
                for r in reads
            ]
    per_block = L * 2 * BS
    assert counts == {
        (HEAD_MAJOR, 2, 2): [2],
        (HEAD_MAJOR, 1, 2): [5],
        (HEAD_MAJOR, 2, 1): [5, 5],
        (BLOCKS_FIRST, 2, 2): [2],
        (BLOCKS_FIRST, 1, 2): [5 * per_block],
        (BLOCKS_FIRST, 2, 1): [5 * per_block, 5 * per_block],
    }
