"""Whole-block READs from prepared block lists (kvtransfer/prepped_blocks.py)."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch

from tandem.kvtransfer.compat import BLOCKS_FIRST
from tandem.kvtransfer.prepped_blocks import PreppedBlocks, count_runs, sorted_block_pairs
from tandem.kvtransfer.side_channel import RegionInfo
from tandem.kvtransfer.tp_plan import BlockGeometry, HeadRead, read_descriptors, shard_for
from tests.kvtransfer.prefill_process import PrefillProcess, kv_content
from tests.kvtransfer.test_progress_while_blocked import COMMON, P_SHAPE, Decode


def test_sorted_pairs_give_the_runs_read_descriptors_merges():
    """Sorting by local id and counting runs gives exactly as many descriptors
    as the address path (tp_plan.read_descriptors) for the same whole blocks."""
    geometry = BlockGeometry(BLOCKS_FIRST, num_layers=2, block_size=4, head_dim=8, elem_size=4)
    shard = shard_for(2, 1, 0)
    whole = HeadRead(0, 0, 2)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        local = rng.permutation(64)[:n].tolist()
        remote = rng.permutation(64)[:n].tolist()
        if rng.random() < 0.3:  # runs that continue each other once sorted
            start = int(rng.integers(0, 20))
            local = [b + start for b in rng.permutation(n).tolist()]
            remote = [b + 7 for b in local]
        ls, rs = sorted_block_pairs(local, remote)
        assert ls.tolist() == sorted(local)
        assert dict(zip(ls.tolist(), rs.tolist())) == dict(zip(local, remote))
        descs = read_descriptors(geometry, shard, shard, whole, local, remote)
        assert count_runs(ls, rs) == len(descs)
    assert count_runs(*sorted_block_pairs([], [])) == 0
    with pytest.raises(ValueError, match="2 local vs 1 remote"):
        sorted_block_pairs([1, 2], [1])


def _agent(name: str, progress_thread: bool):
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(
        enable_prog_thread=progress_thread, backends=["UCX"], capture_telemetry=True
    )
    return nixl_agent(name, config)


def _region(t: torch.Tensor) -> RegionInfo:
    return RegionInfo(t.data_ptr(), t[0].numel() * t.element_size(), t.shape[0], 0, "DRAM")


@pytest.mark.parametrize(
    "local, remote, runs",
    [
        ([2, 3, 4, 9], [5, 6, 7, 20], 2),
        ([9, 4, 2, 3], [20, 7, 5, 6], 2),  # the same blocks listed out of order
        (list(range(10, 40)), list(range(20, 50)), 1),
        ([1, 3, 5, 7], [2, 4, 6, 8], 4),
    ],
)
def test_nixl_posts_one_descriptor_per_run_of_prepared_blocks(local, remote, runs):
    """NIXL's own telemetry: a READ of sorted block ids from prepared lists
    is one descriptor per run, and the bytes land where they belong."""
    target, reader = _agent("prep-target", True), _agent("prep-reader", False)
    p_kv = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    d_kv = torch.zeros(64, 64)
    target.register_memory(p_kv)
    reader.register_memory(d_kv)
    peer = reader.add_remote_agent(target.get_agent_metadata())
    prepped = PreppedBlocks(reader, _region(d_kv))
    try:
        ls, rs = sorted_block_pairs(local, remote)
        handle = prepped.make_read(peer, _region(p_kv), ls, rs)
        state = reader.transfer(handle)
        deadline = time.monotonic() + 20
        while state == "PROC" and time.monotonic() < deadline:
            state = reader.check_xfer_state(handle)
        assert state == "DONE"
        assert reader.get_xfer_telemetry(handle).descCount == count_runs(ls, rs) == runs
        reader.release_xfer_handle(handle)
        assert torch.equal(d_kv[local], p_kv[remote])
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[local] = False
        assert not d_kv[untouched].any()
    finally:
        prepped.close()
        reader.remove_remote_agent(peer)
        del target, reader  # stops the target's progress thread now
        gc.collect()


# (P blocks, D blocks, descriptors): out-of-order runs adjacent once sorted,
# fragmented, contiguous; P_SHAPE has 32 blocks, D 40
TWO_PROCESS_READS = [
    ([6, 7, 4, 5], [18, 19, 16, 17], 1),
    ([3, 9, 10, 1, 20, 21, 22], [30, 12, 13, 5, 6, 7, 8], 4),
    (list(range(8, 24)), list(range(20, 36)), 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("prepped", [True, False])
def test_fragmented_and_contiguous_reads_are_byte_exact_in_the_fewest_descriptors(prepped):
    """Between two processes, both READ paths: D's blocks equal P's, nothing
    else is written, and each READ posts one descriptor per run (sorted)."""
    d = Decode(engine_id="d-prep", nixl_prepped_reads=prepped)
    p = PrefillProcess({"engine_id": "p-prep", **COMMON}, P_SHAPE, seed=3)
    try:
        d.scheduler.set_prefill_endpoints([p.endpoint])
        p_kv = kv_content(P_SHAPE, seed=3)
        for i, (p_blocks, d_blocks, num_descs) in enumerate(TWO_PROCESS_READS):
            d.kv.zero_()
            before = d.worker.stats()["num_descriptors"]
            params = p.finish(f"r{i}", len(p_blocks) * 4, p_blocks)
            req = d.start(f"r{i}", params, d_blocks)
            assert d.received_all({f"r{i}"}, 30.0) == {f"r{i}"}
            for local, remote in zip(d_blocks, p_blocks):
                assert torch.equal(d.kv[local].view(torch.uint8), p_kv[remote].view(torch.uint8))
            others = [b for b in range(d.kv.shape[0]) if b not in d_blocks]
            assert not d.kv[others].any()
            d.finish(req, d_blocks)
            p.wait_done_sending(f"r{i}")
            assert d.worker.stats()["num_descriptors"] - before == num_descs, i
        n = len(TWO_PROCESS_READS)
        counts = (d.worker.agent.num_prepped_reads, d.worker.agent.num_prepared_reads)
        assert counts == ((n, 0) if prepped else (0, n))
        d.close()
    finally:
        p.close()
        d.worker.shutdown()


def test_a_peer_list_that_fails_at_the_handshake_is_prepared_at_the_first_read(caplog):
    """add_peer never fails for want of the prepared list (it would leave the
    peer's agent added but unknown to the table): the first READ prepares it."""
    from tandem.kvtransfer.nixl_agent import NixlAgent, make_agent_name

    target = NixlAgent(make_agent_name("prep-fail-p", 0), progress_thread=True)
    reader = NixlAgent(make_agent_name("prep-fail-d", 0), prepped_reads=True)
    p_kv = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64)
    d_kv = torch.zeros(32, 64)
    try:
        p_region, _ = target.register(p_kv), reader.register(d_kv)
        prepped = reader._prepped
        real_prepare = prepped.prepare_peer
        calls = []

        def failing_once(name, region):
            calls.append(name)
            if len(calls) == 1:
                raise RuntimeError("injected prep failure")
            return real_prepare(name, region)

        prepped.prepare_peer = failing_once
        with caplog.at_level("WARNING", logger="tandem.kvtransfer.nixl_agent"):
            peer = reader.add_peer(target.metadata, p_region)
        assert "injected prep failure" in caplog.text
        handle, state, num_descs = reader.start_block_read(peer, p_region, [5, 6, 1], [10, 11, 2])
        deadline = time.monotonic() + 20
        while state == "PROC" and time.monotonic() < deadline:
            state = reader.check(handle)
        assert state == "DONE" and num_descs == 2 and len(calls) == 2
        assert reader.release(handle)
        assert torch.equal(d_kv[[5, 6, 1]], p_kv[[10, 11, 2]])
    finally:
        reader.close()
        target.close()
