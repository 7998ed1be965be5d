import numpy as np
import pytest

from tandem.kvtransfer.compat import BLOCKS_FIRST
from tandem.kvtransfer.nixl_agent import split_block_runs
from tandem.kvtransfer.tp_plan import BlockGeometry, HeadRead, read_descriptors, shard_for


def test_runs_split_where_either_side_breaks():
    local = [7, 8, 9, 3, 4]
    remote = [20, 21, 5, 6, 7]
    assert split_block_runs(local, remote) == [(7, 20, 2), (9, 5, 1), (3, 6, 2)]


def test_one_run_when_both_contiguous():
    assert split_block_runs(list(range(10, 74)), list(range(100, 164))) == [(10, 100, 64)]


def test_every_block_separate():
    assert split_block_runs([5, 3, 1], [0, 1, 2]) == [(5, 0, 1), (3, 1, 1), (1, 2, 1)]
    assert split_block_runs([0, 1, 2], [4, 2, 0]) == [(0, 4, 1), (1, 2, 1), (2, 0, 1)]


def test_empty_and_mismatch():
    assert split_block_runs([], []) == []
    with pytest.raises(ValueError):
        split_block_runs([1, 2], [1])


def test_runs_cover_exactly_the_pairs():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        local = rng.permutation(40)[:n].tolist()
        remote = sorted(rng.permutation(40)[:n].tolist())
        pairs = [
            (ls + i, rs + i)
            for ls, rs, length in split_block_runs(local, remote)
            for i in range(length)
        ]
        assert pairs == list(zip(local, remote))


def test_whole_block_descriptors_are_the_runs():
    """Same TP on both sides: one descriptor per run of blocks adjacent on both
    sides (in any order in the request), at base + start * block_len."""
    geometry = BlockGeometry(BLOCKS_FIRST, num_layers=2, block_size=4, head_dim=8, elem_size=4)
    shard = shard_for(4, 2, 1)
    block_len = geometry.block_len(shard.num_heads)
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        local = rng.permutation(40)[:n].tolist()
        remote = sorted(rng.permutation(40)[:n].tolist())
        read = HeadRead(1, shard.head_start, shard.num_heads)
        descs = read_descriptors(geometry, shard, shard, read, local, remote, 4096, 8192)
        pairs = sorted(zip(local, remote))  # pieces merge in local address order
        runs = split_block_runs([p[0] for p in pairs], [p[1] for p in pairs])
        assert descs.local_addrs.tolist() == [4096 + ls * block_len for ls, _, _ in runs]
        assert descs.remote_addrs.tolist() == [8192 + rs * block_len for _, rs, _ in runs]
        assert descs.lengths.tolist() == [length * block_len for _, _, length in runs]
