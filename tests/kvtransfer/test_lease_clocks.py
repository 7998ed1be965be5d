"""Lease arithmetic when P's and D's clocks disagree by ±30 s.

Each side runs on its own injected monotonic clock; ``true_s`` is the time a
perfect observer would read. What travels is P's remaining lease (a
duration), so D's deadline lands just before P frees the blocks, whatever
the offset; with absolute times it would be 30 s early or 30 s late.
"""

from __future__ import annotations

import pytest

from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.nixl_scheduler import NixlSchedulerSide
from tandem.kvtransfer.nixl_worker import NixlWorkerSide
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import SamplingParams

BS = 4
LEASE_S = 10.0
MARGIN_S = 1.0
TRANSIT_S = 0.05  # P -> gateway -> D


class World:
    def __init__(self) -> None:
        self.true_s = 0.0

    def clock(self, base_s: float, offset_s: float):
        return lambda: base_s + self.true_s + offset_s


def config(role: str, engine_id: str) -> KVTransferConfig:
    return KVTransferConfig(
        role=role, engine_id=engine_id, block_size=BS, lease_s=LEASE_S, lease_margin_s=MARGIN_S
    )


def handoff(world: World, p_offset_s: float, d_offset_s: float):
    """P finishes a prefill at true 0; D receives the params TRANSIT_S later.
    Returns (P's SendSpec, D's LoadSpec, D's clock)."""
    p_clock = world.clock(7000.0, p_offset_s)
    d_clock = world.clock(7000.0, d_offset_s)
    p = NixlSchedulerSide(config("prefill", "p0"), clock=p_clock)
    d = NixlSchedulerSide(config("decode", "d0"), clock=d_clock)
    d.set_prefill_endpoints([["p0", 0, "127.0.0.1", 5555]])
    world.true_s = 0.0
    req = Request("r", list(range(8)), SamplingParams(max_tokens=1), kv_transfer_params={})
    req.kv_transfer_params = {"do_remote_decode": True}
    req.num_computed_tokens = 8
    req.append_output_token(1)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished(req, [3, 4])
    (send,) = p.build_connector_meta(None).new_sends
    world.true_s = TRANSIT_S
    # the request object is created when D receives it: its arrival is on D's clock
    d_req = Request("r", list(range(9)), SamplingParams(), kv_transfer_params=params)
    d_req.arrival_mono = d_clock()
    assert d.get_num_new_matched_tokens(d_req, 0) == (8, True)
    d.update_state_after_alloc(d_req, [10, 11], 8)
    (load,) = d.build_connector_meta(None).loads
    return send, load, d_clock, p_clock


@pytest.mark.parametrize(
    ("p_offset_s", "d_offset_s"),
    [(30.0, 0.0), (-30.0, 0.0), (0.0, 30.0), (30.0, -30.0), (-30.0, 30.0)],
)
def test_d_stops_before_p_frees_under_clock_offset(p_offset_s, d_offset_s):
    world = World()
    send, load, _, _ = handoff(world, p_offset_s, d_offset_s)
    p_frees_true_s = send.lease_deadline_mono - 7000.0 - p_offset_s
    d_stops_true_s = load.lease_deadline_mono - 7000.0 - d_offset_s
    assert p_frees_true_s == pytest.approx(LEASE_S)
    # D gives up MARGIN_S before P frees, counted from when D got the params
    assert d_stops_true_s == pytest.approx(TRANSIT_S + LEASE_S - MARGIN_S)
    assert d_stops_true_s < p_frees_true_s
    assert load.error == ""


@pytest.mark.parametrize("d_offset_s", [30.0, -30.0])
def test_late_load_is_refused_by_d_clock_and_p_expires_by_its_own(d_offset_s):
    world = World()
    p_offset_s = -d_offset_s
    _, _, d_clock, p_clock = handoff(world, p_offset_s, d_offset_s)
    # a second handoff whose D-side load is only allocated after D's deadline
    p = NixlSchedulerSide(config("prefill", "p0"), clock=p_clock)
    d = NixlSchedulerSide(config("decode", "d0"), clock=d_clock)
    d.set_prefill_endpoints([["p0", 0, "127.0.0.1", 5555]])
    world.true_s = 0.0
    req = Request("r2", list(range(8)), SamplingParams(max_tokens=1))
    req.kv_transfer_params = {"do_remote_decode": True}
    req.num_computed_tokens = 8
    req.append_output_token(1)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished(req, [5, 6])
    send_meta = p.build_connector_meta(None)
    d_req = Request("r2", list(range(9)), SamplingParams(), kv_transfer_params=params)
    d_req.arrival_mono = d_clock()
    assert d.get_num_new_matched_tokens(d_req, 0) == (8, True)
    world.true_s = LEASE_S - MARGIN_S + 0.01  # D waited for blocks without renewing
    d._remote["r2"].last_renew_mono = d_clock()  # (renewal not due: isolate the arithmetic)
    d.update_state_after_alloc(d_req, [10, 11], 8)
    (load,) = d.build_connector_meta(None).loads
    assert "lease expired" in load.error

    # P's worker frees on its own clock at exactly lease_s, whatever D's offset
    worker = NixlWorkerSide(config("prefill", "p0"), clock=p_clock)
    try:
        world.true_s = 0.0
        worker.start_load_kv(send_meta)
        world.true_s = LEASE_S - 0.01
        assert worker.get_finished()[0] == set()
        world.true_s = LEASE_S
        assert worker.get_finished()[0] == {"r2"}
        worker.check_integrity()
    finally:
        worker.shutdown()
