"""Quarantine of blocks whose READ may still land, over real NIXL/UCX.

UCX runs on TCP only here (``UCX_TLS=tcp``): a READ then needs the prefill
process to progress UCX, so stopping P (SIGSTOP) leaves D's READ really in
flight ("PROC") past its deadline. Over TCP NIXL can cancel such a READ;
the case where it cannot (NIXL's documented refusal of
``release_xfer_handle``) is provoked with ``NixlAgent.test_refuse_release``,
which refuses exactly while NIXL still reports the READ in progress.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch

from tandem.kvtransfer import KVTransferConfig, create_connector
from tandem.scheduler.request import Request
from tandem.wire.engine_protocol import SamplingParams
from tests.kvtransfer.prefill_process import PrefillProcess, kv_content

pytestmark = pytest.mark.slow

BS = 4
P_SHAPE = (32, 2, 2, BS, 2, 64)
D_SHAPE = (40, 2, 2, BS, 2, 64)
COMMON = {"block_size": BS, "model_name": "tiny"}
TCP = {"UCX_TLS": "tcp"}


@pytest.fixture
def setup(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    scheduler, worker = create_connector(
        KVTransferConfig(role="decode", engine_id="d0", load_timeout_s=1.0, **COMMON)
    )
    kv = torch.zeros(D_SHAPE)
    worker.register_kv_caches(kv)
    proc = PrefillProcess({"engine_id": "p0", "epoch": 0, **COMMON}, P_SHAPE, 0, env=TCP)
    scheduler.set_prefill_endpoints([proc.endpoint])
    try:
        yield scheduler, worker, kv, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.process.pid, signal.SIGCONT)
        proc.close()
        worker.shutdown()


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, "the prefill process did not stop"
        time.sleep(0.005)


def start(scheduler, worker, request_id, params, num_prompt, local_block_ids):
    req = Request(
        request_id, list(range(num_prompt + 1)), SamplingParams(), kv_transfer_params=params
    )
    num_external, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, local_block_ids, num_external)
    worker.start_load_kv(scheduler.build_connector_meta(None))


def poll_until(worker, request_id, timeout_s):
    """Poll D for ``timeout_s``; True as soon as the request is reported."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if request_id in worker.get_finished()[1]:
            return True
        time.sleep(0.01)
    return False


def read_ok(setup, request_id, p_blocks, d_blocks):
    scheduler, worker, d_kv, proc = setup
    start(scheduler, worker, request_id, proc.finish(request_id, 16, p_blocks), 16, d_blocks)
    assert poll_until(worker, request_id, 20.0)
    assert worker.get_block_ids_with_load_errors() == set()


def test_refused_release_quarantines_blocks_until_the_late_read_lands(setup):
    scheduler, worker, d_kv, proc = setup
    p_kv = kv_content(P_SHAPE, seed=0)
    read_ok(setup, "warm", [0, 1, 2, 3], [0, 1, 2, 3])  # handshake done, TCP works
    agent = worker.agent
    agent.test_refuse_release = lambda handle: agent.check(handle) == "PROC"
    agent.test_refuse_remove_peer = lambda name: True  # removing the peer fails too
    params = proc.finish("late", 16, [8, 9, 10, 11])
    stop(proc.process.pid)  # P stops progressing UCX
    start(scheduler, worker, "late", params, 16, [20, 21, 22, 23])
    # past the 1 s deadline the READ is still in flight: not reported, blocks held
    assert not poll_until(worker, "late", 2.5)
    stats = worker.stats()
    assert stats["num_loads_quarantined"] == 1 and stats["num_loads_in_flight"] == 0
    with pytest.raises(AssertionError, match="quarantined"):
        worker.check_integrity()
    os.kill(proc.process.pid, signal.SIGCONT)  # the READ now completes...
    assert poll_until(worker, "late", 20.0)  # ...and only then is the load reported
    assert worker.get_block_ids_with_load_errors() == {20, 21, 22, 23}  # failed: recompute
    for local, remote in zip([20, 21, 22, 23], [8, 9, 10, 11]):
        # the late READ did land: had the blocks been reused, it would have overwritten them
        assert torch.equal(d_kv[local], p_kv[remote])
    assert worker.stats()["num_quarantined_loads_total"] == 1
    worker.check_integrity()


def test_refused_release_removes_the_peer_and_nothing_lands(setup):
    scheduler, worker, d_kv, proc = setup
    read_ok(setup, "warm", [0, 1, 2, 3], [0, 1, 2, 3])
    worker.agent.test_refuse_release = lambda handle: True  # NIXL never frees the handle
    params = proc.finish("late", 16, [8, 9, 10, 11])
    stop(proc.process.pid)
    start(scheduler, worker, "late", params, 16, [20, 21, 22, 23])
    # at the deadline the peer's agent is removed: no READ of it can land, so
    # the blocks are reported (as load errors) without waiting for P
    assert poll_until(worker, "late", 15.0)
    assert worker.get_block_ids_with_load_errors() == {20, 21, 22, 23}
    assert worker.stats()["num_quarantined_loads_total"] == 0
    os.kill(proc.process.pid, signal.SIGCONT)
    proc.ping()  # P runs (and progresses UCX) again
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        worker.get_finished()
        time.sleep(0.01)
    assert not d_kv[20:24].any(), "a READ landed after its peer was removed"
    worker.agent.test_refuse_release = None
    read_ok(setup, "after", [4, 5, 6, 7], [30, 31, 32, 33])  # re-handshakes and reads
    assert worker.stats()["num_handshakes"] == 2
    worker.check_integrity()
