"""Whole-block READs from prepared block lists (kvtransfer/prepped_blocks.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.prepped_blocks import block_indices
from kvtransfer.side_channel import RegionInfo
from tests.kvtransfer.prefill_process import PrefillProcess, kv_content
from tests.kvtransfer.test_progress_while_blocked import COMMON, P_SHAPE, Decode

REGION = RegionInfo(base_addr=1 << 20, block_len=256, num_blocks=10, device_id=0, mem_type="DRAM")


def test_block_indices_of_whole_block_pieces():
    base, bl = REGION.base_addr, REGION.block_len
    addrs = np.array([base + 4 * bl, base + 1 * bl, base + 9 * bl])
    lengths = np.array([3 * bl, bl, bl])
    assert block_indices(addrs, lengths, REGION).tolist() == [4, 5, 6, 1, 9]


def test_many_pieces_take_the_array_path_with_the_same_answer():
    region = RegionInfo(base_addr=4096, block_len=64, num_blocks=100, device_id=0, mem_type="DRAM")
    rng = np.random.default_rng(0)
    for _ in range(20):
        starts = rng.permutation(90)[:12]
        counts = rng.integers(1, 4, size=12)
        addrs = region.base_addr + starts * region.block_len
        expected = [b for s, c in zip(starts, counts) for b in range(s, s + c)]
        assert block_indices(addrs, counts * region.block_len, region).tolist() == expected
    ones = np.arange(0, 40, 2)
    addrs = region.base_addr + ones * region.block_len
    lengths = np.full(len(ones), region.block_len)
    assert block_indices(addrs, lengths, region).tolist() == ones.tolist()
    assert block_indices(addrs + 1, lengths, region) is None


@pytest.mark.parametrize(
    "addr_blocks, length_bytes",
    [
        ([2.5], 256),  # starts inside a block (a head slice)
        ([2], 128),  # shorter than a block
        ([9], 512),  # runs past the last block
        ([-1], 256),  # before the region
    ],
)
def test_pieces_that_are_not_whole_blocks_fall_back(addr_blocks, length_bytes):
    addrs = np.array([int(REGION.base_addr + b * REGION.block_len) for b in addr_blocks])
    assert block_indices(addrs, np.array([length_bytes]), REGION) is None


@pytest.mark.slow
@pytest.mark.parametrize("prepped", [True, False])
def test_out_of_order_runs_read_as_one_descriptor(prepped):
    """P blocks [6, 7, 4, 5] -> D blocks [18, 19, 16, 17]: adjacent on both
    sides once sorted, so one descriptor; bytes equal with both READ paths."""
    d = Decode(engine_id="d-prep", nixl_prepped_reads=prepped)
    p = PrefillProcess({"engine_id": "p-prep", **COMMON}, P_SHAPE, seed=3)
    try:
        d.scheduler.set_prefill_endpoints([p.endpoint])
        p_blocks, d_blocks = [6, 7, 4, 5], [18, 19, 16, 17]
        params = p.finish("r", 16, p_blocks)
        req = d.start("r", params, d_blocks)
        assert d.received_all({"r"}, 30.0) == {"r"}
        p_kv = kv_content(P_SHAPE, seed=3)
        assert torch.equal(d.kv[16:20].view(torch.uint8), p_kv[4:8].view(torch.uint8))
        assert not d.kv[:16].any() and not d.kv[20:].any()
        d.finish(req, d_blocks)
        p.wait_done_sending("r")
        assert d.worker.stats()["num_descriptors"] == 1
        counts = (d.worker.agent.num_prepped_reads, d.worker.agent.num_prepared_reads)
        assert counts == ((1, 0) if prepped else (0, 1))
        d.close()
    finally:
        p.close()
        d.worker.shutdown()
