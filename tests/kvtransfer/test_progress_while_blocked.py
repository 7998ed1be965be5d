"""A decode engine's READ completes while the prefill engine's loop is blocked.

Real NIXL/UCX between two OS processes. P's UCX is limited to TCP
(``UCX_TLS=tcp``): on one host UCX would otherwise pick ``cma``, whose READ
the kernel copies inside D's post without P, which would prove nothing. Over
TCP (as between hosts without RDMA, and like the GPU transports of issue
#10) a READ needs P's UCX worker to progress. P blocks its loop for 5 s in
three ways (``prefill_process.block_loop``) right after handing out the
params; D's READ must land, byte-exact, well before P's loop comes back,
except in the control, where nothing progresses P.
"""

from __future__ import annotations

import time

import pytest
import torch

from tandem.kvtransfer import KVTransferConfig, create_connector
from tandem.scheduler.messages import KVConnectorOutput
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import SamplingParams
from tests.kvtransfer.prefill_process import PrefillProcess, kv_content

pytestmark = pytest.mark.slow

BS = 4
P_SHAPE = (32, 2, 2, BS, 2, 8)
D_SHAPE = (40, 2, 2, BS, 2, 8)
COMMON = {"block_size": BS, "model_name": "tiny"}
TCP_ONLY = {"UCX_TLS": "tcp"}
BLOCK_S = 5.0
READ_DEADLINE_S = 3.0  # well under BLOCK_S: only a progressing P can meet it


class Decode:
    """D's connector halves driven by hand, one request at a time."""

    def __init__(self, engine_id: str = "d-blocked", **config) -> None:
        self.scheduler, self.worker = create_connector(
            KVTransferConfig(role="decode", engine_id=engine_id, **COMMON, **config)
        )
        self.kv = torch.zeros(D_SHAPE, device=config.get("device", "cpu"))
        self.worker.register_kv_caches(self.kv)

    def start(self, request_id: str, params: dict, blocks: list[int]) -> Request:
        num_tokens = params["num_tokens"]
        req = Request(
            request_id, list(range(num_tokens + 1)), SamplingParams(), kv_transfer_params=params
        )
        num_external, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert num_external == num_tokens
        self.scheduler.update_state_after_alloc(req, blocks, num_external)
        self.worker.start_load_kv(self.scheduler.build_connector_meta(None))
        return req

    def received_all(self, request_ids: set[str], timeout_s: float) -> set[str]:
        """The ids of ``request_ids`` received within ``timeout_s`` (polling
        like an engine loop); returns early once all are in."""
        received: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while received != request_ids and time.monotonic() < deadline:
            received |= self.worker.get_finished()[1] & request_ids
            time.sleep(0.002)
        return received

    def finish(self, req: Request, blocks: list[int]) -> None:
        assert self.worker.get_block_ids_with_load_errors() == set()
        self.scheduler.update_connector_output(KVConnectorOutput(finished_recving=[req.request_id]))
        req.status = RequestStatus.FINISHED_STOPPED
        self.scheduler.request_finished(req, blocks)

    def close(self) -> None:
        self.worker.check_integrity()
        self.scheduler.check_integrity()
        self.worker.shutdown()


@pytest.fixture
def decode():
    d = Decode()
    try:
        yield d
    finally:
        d.worker.shutdown()


def warm_up(p: PrefillProcess, d: Decode) -> None:
    """One request before blocking: the handshake (served by P's side channel
    thread) and UCX's connection are in place, as for a running service."""
    params = p.finish("warm", 8, [30, 31])
    req = d.start("warm", params, [38, 39])
    assert d.received_all({"warm"}, 30.0) == {"warm"}
    d.finish(req, [38, 39])
    p.wait_done_sending("warm")


# (engine id, config, how P's loop blocks, must D's READ land while P is blocked)
SCENARIOS = [
    # default: the progress poller (a Python thread); a pure-Python loop hands
    # it the GIL every 5 ms, a C call like sleep releases it
    ("p-poller-python", {}, "python", True),
    ("p-poller-sleep", {}, "sleep", True),
    # a C call that holds the GIL starves any Python thread; NIXL's own
    # progress thread (C++) still serves the READ
    ("p-thread-c-gil", {"nixl_progress_thread": True}, "c_gil", True),
    # the control: no poller, no thread: the READ waits for P's loop
    ("p-none-sleep", {"nixl_progress_poll_interval_s": 0.0}, "sleep", False),
]


def test_reads_land_while_prefill_loops_are_blocked(decode):
    """Four prefill processes at once (one per scenario, so the 5 s blocks
    overlap), each blocked right after handing out its params."""
    procs: list[PrefillProcess] = []
    try:
        for i, (engine_id, config, _, _) in enumerate(SCENARIOS):
            procs.append(
                PrefillProcess(
                    {"engine_id": engine_id, **config, **COMMON}, P_SHAPE, seed=i, env=TCP_ONLY
                )
            )
        decode.scheduler.set_prefill_endpoints([p.endpoint for p in procs])
        for p in procs:
            warm_up(p, decode)
        p_blocks = [5, 6, 12]  # runs 5-6 | 12
        d_blocks = {p.engine_id: [4 * i, 4 * i + 1, 4 * i + 3] for i, p in enumerate(procs)}
        params = {p.engine_id: p.finish("r", 12, p_blocks) for p in procs}
        polls_before = {p.engine_id: p.stats()["num_progress_polls"] for p in procs}
        for p, (_, _, how, _) in zip(procs, SCENARIOS):
            p.block(BLOCK_S, how)
        requests = {}
        for p in procs:
            request_id = f"from-{p.engine_id}"
            requests[p.engine_id] = decode.start(
                request_id, params[p.engine_id], d_blocks[p.engine_id]
            )
        landed = decode.received_all({r.request_id for r in requests.values()}, READ_DEADLINE_S)
        expected = {eid for eid, _, _, while_blocked in SCENARIOS if while_blocked}
        assert {rid.removeprefix("from-") for rid in landed} == expected, (
            f"READs landed within {READ_DEADLINE_S} s of P's {BLOCK_S} s blocks: "
            f"{sorted(landed)}; D: {decode.worker.stats()}"
        )
        late = {f"from-{eid}" for eid in set(requests) - expected}
        assert decode.received_all(late, 30.0) == late  # the control's P is back
        for i, p in enumerate(procs):
            p_kv = kv_content(P_SHAPE, seed=i)
            for local, remote in zip(d_blocks[p.engine_id], p_blocks):
                assert torch.equal(
                    decode.kv[local].view(torch.uint8), p_kv[remote].view(torch.uint8)
                ), (p.engine_id, local, remote)
            decode.finish(requests[p.engine_id], d_blocks[p.engine_id])
        for p in procs:  # each loop is back: it takes D's "done" and frees its blocks
            p.wait_done_sending("r", timeout_s=BLOCK_S + 20)
            stats = p.stats()
            assert stats["num_blocks_held_for_transfer"] == 0, p.engine_id
            assert stats["num_lease_expiries"] == 0, p.engine_id
        polled = {
            p.engine_id: p.stats()["num_progress_polls"] > polls_before[p.engine_id] for p in procs
        }
        assert polled == {
            "p-poller-python": True,
            "p-poller-sleep": True,
            "p-thread-c-gil": False,  # NIXL's thread replaces the poller
            "p-none-sleep": False,
        }
    finally:
        for p in procs:
            p.close()
    decode.close()
