import numpy as np
import pytest

from kvtransfer.nixl_agent import run_descriptors, split_block_runs
from kvtransfer.side_channel import RegionInfo


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


def test_descriptors_address_whole_blocks():
    region = RegionInfo(base_addr=4096, block_len=1000, num_blocks=50, device_id=0, mem_type="DRAM")
    descs = run_descriptors(region, [7, 9], [2, 1])
    assert descs.dtype == np.uint64
    assert descs.tolist() == [[4096 + 7000, 2000, 0], [4096 + 9000, 1000, 0]]
