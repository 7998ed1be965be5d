"""The NIXL connector across two OS processes over real NIXL/UCX (loopback).

The prefill engine runs in a spawned child (``prefill_process.py``) with a
KV tensor of known random content; this process is the decode engine.
"""

from __future__ import annotations

import contextlib
import logging
import time

import pytest
import torch

from tandem.kvtransfer import KVTransferConfig, create_connector
from tandem.kvtransfer.nixl_meta import LoadSpec, NixlConnectorMetadata, PeerAddr
from tandem.scheduler.messages import KVConnectorOutput
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import SamplingParams
from tests.kvtransfer.prefill_process import PrefillProcess, kv_content

pytestmark = pytest.mark.slow

BS = 4
P_SHAPE = (32, 2, 2, BS, 2, 8)  # [blocks, layers, K/V, block_size, kv heads, head dim]
D_SHAPE = (40, 2, 2, BS, 2, 8)
COMMON = {"block_size": BS, "model_name": "tiny"}


@pytest.fixture
def decode():
    scheduler, worker = create_connector(KVTransferConfig(role="decode", engine_id="d0", **COMMON))
    kv = torch.zeros(D_SHAPE)
    worker.register_kv_caches(kv)
    try:
        yield scheduler, worker, kv
    finally:
        worker.shutdown()


# what the cluster would have registered with D: engine id -> latest endpoint
_REGISTERED: dict[str, list] = {}


@pytest.fixture(autouse=True)
def _fresh_registrations():
    _REGISTERED.clear()
    yield
    _REGISTERED.clear()


@contextlib.contextmanager
def prefill(engine_id="p0", epoch=0, seed=0, shape=P_SHAPE, **kwargs):
    proc = PrefillProcess({"engine_id": engine_id, "epoch": epoch, **COMMON, **kwargs}, shape, seed)
    _REGISTERED[engine_id] = proc.endpoint
    try:
        yield proc
    finally:
        proc.close()


def pull(decode, request_id, params, num_prompt, local_block_ids, num_local=0, timeout_s=15.0):
    """Drive D's connector for one request until the worker reports it received."""
    scheduler, worker, _ = decode
    scheduler.set_prefill_endpoints(list(_REGISTERED.values()))
    req = Request(
        request_id,
        list(range(num_prompt + 1)),  # prompt + P's first token
        SamplingParams(max_tokens=4),
        kv_transfer_params=params,
    )
    num_external, is_async = scheduler.get_num_new_matched_tokens(req, num_local)
    scheduler.update_state_after_alloc(req, local_block_ids, num_external)
    worker.start_load_kv(scheduler.build_connector_meta(None))
    deadline = time.monotonic() + timeout_s
    while True:
        _, done_recving = worker.get_finished()
        if request_id in done_recving:
            break
        assert time.monotonic() < deadline, f"{request_id} not received within {timeout_s} s"
        time.sleep(0.001)
    errors = worker.get_block_ids_with_load_errors()
    scheduler.update_connector_output(KVConnectorOutput(finished_recving=[request_id]))
    req.status = RequestStatus.FINISHED_STOPPED
    scheduler.request_finished(req, local_block_ids)
    return num_external, errors


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_blocks(d_kv, expected_p_kv, pairs, untouched):
    for local, remote in pairs:
        assert torch.equal(as_bytes(d_kv[local]), as_bytes(expected_p_kv[remote])), (local, remote)
    for block in untouched:
        assert not d_kv[block].any(), f"block {block} was written"


def test_read_noncontiguous_blocks_then_notify(decode):
    _, worker, d_kv = decode
    p_kv = kv_content(P_SHAPE, seed=0)
    with prefill() as p:
        # 23 tokens -> 6 blocks, the last one partial
        p_blocks = [5, 6, 7, 12, 13, 3]
        d_blocks = [10, 11, 2, 3, 4, 20]
        params = p.finish("r1", 23, p_blocks)
        assert params["remote_block_ids"] == p_blocks and params["num_tokens"] == 23
        num_external, errors = pull(decode, "r1", params, 23, d_blocks)
        assert (num_external, errors) == (23, set())
        assert_blocks(d_kv, p_kv, zip(d_blocks, p_blocks), set(range(40)) - set(d_blocks))
        stats = worker.stats()
        # runs: 10-11 <- 5-6 | 2 <- 7 | 3-4 <- 12-13 | 20 <- 3
        assert stats["num_descriptors"] == 4 and stats["num_transfers"] == 1
        assert stats["kv_transfer_bytes_total"] == 6 * d_kv[0].numel() * 4
        assert len(worker.drain_transfer_seconds()) == 1 and worker.drain_transfer_seconds() == []
        p.wait_done_sending("r1")  # D's notification freed P's blocks
        assert p.stats()["num_blocks_held_for_transfer"] == 0

        # second request: local prefix hit of 2 blocks -> only the 3 trailing blocks travel
        d_kv[30:32] = 7.0
        params = p.finish("r2", 18, [20, 21, 22, 23, 24])
        num_external, errors = pull(decode, "r2", params, 18, [30, 31, 32, 33, 34], num_local=8)
        assert (num_external, errors) == (10, set())
        assert bool((d_kv[30:32] == 7.0).all())
        assert_blocks(d_kv, p_kv, [(32, 22), (33, 23), (34, 24)], [35, 36])
        stats = worker.stats()
        assert stats["num_handshakes"] == 1 and stats["num_descriptors"] == 5
        p.wait_done_sending("r2")
        assert p.stats()["num_lease_expiries"] == 0
    worker.check_integrity()
    decode[0].check_integrity()


def test_incompatible_peer_is_refused(decode, caplog):
    _, worker, d_kv = decode
    with prefill(shape=(32, 2, 2, BS, 2, 16)) as p:  # head_dim 16 vs our 8
        params = p.finish("r1", 8, [1, 2])
        with caplog.at_level(logging.WARNING, logger="tandem.kvtransfer"):
            num_external, errors = pull(decode, "r1", params, 8, [5, 6])
        assert (num_external, errors) == (8, {5, 6})
        assert "incompatible KV blocks: head_dim: local=8 remote=16" in caplog.text
        assert not d_kv.any()
        stats = worker.stats()
        assert stats["num_failures"] == 1 and stats["num_handshake_failures"] == 1


def test_restarted_prefill_is_rehandshaked_and_read_fresh(decode, caplog):
    _, worker, d_kv = decode
    blocks = [3, 4, 5]
    with prefill(epoch=1, seed=1) as p1:
        params = p1.finish("a", 12, blocks)
        stale_params = p1.finish("b", 12, blocks)
        assert pull(decode, "a", params, 12, [0, 1, 2]) == (12, set())
        assert_blocks(d_kv, kv_content(P_SHAPE, seed=1), zip([0, 1, 2], blocks), [])
    # P1 is gone: reading from it fails cleanly (peer gone), nothing hangs
    with caplog.at_level(logging.WARNING, logger="tandem.kvtransfer"):
        assert pull(decode, "b", stale_params, 12, [6, 7, 8]) == (12, {6, 7, 8})
    with prefill(epoch=2, seed=2) as p2:
        params = p2.finish("c", 12, blocks)
        assert params["remote_epoch"] == 2
        assert pull(decode, "c", params, 12, [0, 1, 2]) == (12, set())
        assert_blocks(d_kv, kv_content(P_SHAPE, seed=2), zip([0, 1, 2], blocks), [])
        assert not torch.equal(kv_content(P_SHAPE, seed=1)[3], kv_content(P_SHAPE, seed=2)[3])
        # params naming the old epoch are refused without touching the network
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tandem.kvtransfer"):
            assert pull(
                decode, "d", stale_params | {"remote_request_id": "d"}, 12, [9, 10, 11]
            ) == (
                12,
                {9, 10, 11},
            )
        assert "epoch 1 is not its registered epoch 2" in caplog.text
        p2.wait_done_sending("c")
    assert worker.stats()["num_handshakes"] == 2
    worker.check_integrity()
    decode[0].check_integrity()


@pytest.mark.parametrize("transport", ["side_channel", "nixl"])
def test_lease_expiry_renewal_and_done_notification(transport):
    lease_s = 1.0
    config = KVTransferConfig(
        role="decode", engine_id="d0", lease_s=lease_s, notification_transport=transport, **COMMON
    )
    scheduler, worker = create_connector(config)
    d_kv = torch.zeros(D_SHAPE)
    worker.register_kv_caches(d_kv)
    try:
        with prefill(lease_s=lease_s) as p:
            p.finish("orphan", 8, [1, 2])
            elapsed = p.wait_done_sending("orphan", timeout_s=10)
            assert elapsed >= lease_s
            stats = p.stats()
            assert stats["num_lease_expiries"] == 1 and stats["num_blocks_held_for_transfer"] == 0

            params = p.finish("waiting", 8, [3, 4])
            # D sees the request as if it had waited 0.4 s for blocks: it renews now
            scheduler.set_prefill_endpoints([p.endpoint])
            req = Request("waiting", list(range(9)), SamplingParams(), kv_transfer_params=params)
            req.arrival_mono -= 0.4
            assert scheduler.get_num_new_matched_tokens(req, 0) == (8, True)
            meta = scheduler.build_connector_meta(None)
            assert [n.kind for n in meta.notifies] == ["renew"]
            renew_sent_after = time.time()
            worker.start_load_kv(meta)
            deadline = time.monotonic() + 10
            while not p.poll_done_sending("waiting", 0.01):
                worker.get_finished()  # (nixl transport) lets the handshake finish
                assert time.monotonic() < deadline
            assert time.time() >= renew_sent_after + lease_s
            assert p.stats()["num_lease_renewals"] == 1
            req.status = RequestStatus.FINISHED_ABORTED
            scheduler.request_finished(req, [])

            # a pulled request: P frees on D's "done", well before its lease
            params = p.finish("pulled", 8, [5, 6])
            assert pull((scheduler, worker, d_kv), "pulled", params, 8, [7, 8]) == (8, set())
            assert p.wait_done_sending("pulled", timeout_s=10) < lease_s
            assert p.stats()["num_lease_expiries"] == 2  # "orphan" and "waiting", not "pulled"
            assert_blocks(d_kv, kv_content(P_SHAPE, seed=0), [(7, 5), (8, 6)], [])
    finally:
        worker.shutdown()


def test_unreachable_peer_fails_after_handshake_timeout():
    scheduler, worker = create_connector(
        KVTransferConfig(role="decode", engine_id="d1", handshake_timeout_s=0.3, **COMMON)
    )
    try:
        worker.register_kv_caches(torch.zeros(D_SHAPE))
        dead = PeerAddr("nobody", 0, "127.0.0.1", 9)  # discard port: nothing answers
        spec = LoadSpec("x", dead, "x", [1, 2], [1, 2], time.monotonic() + 60)
        worker.start_load_kv(NixlConnectorMetadata(loads=[spec]))
        deadline = time.monotonic() + 10
        while "x" not in worker.get_finished()[1]:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert worker.get_block_ids_with_load_errors() == {1, 2}
        assert worker.stats()["num_handshake_failures"] == 1
    finally:
        worker.shutdown()
