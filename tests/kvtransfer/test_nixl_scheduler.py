"""Scheduler-side bookkeeping of the NIXL connector, with real Request objects."""

import time

import pytest

from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.nixl_meta import LoadSpec, NotifySpec, PeerAddr, SendSpec
from tandem.kvtransfer.nixl_scheduler import NixlSchedulerSide
from tandem.scheduler.messages import KVConnectorOutput, SchedulerOutput
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import SamplingParams

BS = 4
PEER = PeerAddr("p0", 3, "10.0.0.1", 5555)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(role: str = "both", lease_s: float = 60.0, clock=time.monotonic) -> NixlSchedulerSide:
    config = KVTransferConfig(
        role=role,
        engine_id="e0",
        epoch=7,
        block_size=BS,
        side_channel_host="10.9.9.9",
        lease_s=lease_s,
    )
    conn = NixlSchedulerSide(config, clock=clock)
    conn.set_prefill_endpoints([["p0", 3, "10.0.0.1", 5555]])
    return conn


def p_request(rid: str, num_prompt: int, params=None) -> Request:
    return Request(
        rid,
        list(range(num_prompt)),
        SamplingParams(max_tokens=1),
        kv_transfer_params={"do_remote_decode": True} if params is None else params,
    )


def d_params(num_tokens: int, block_ids: list[int], remaining_s: float = 60.0) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "p0",
        "remote_block_ids": block_ids,
        "remote_request_id": "p-req",
        "num_tokens": num_tokens,
        "remote_epoch": 3,
        "lease_remaining_s": remaining_s,
    }


def d_request(
    rid: str, num_prompt: int, params: dict, arrival_mono: float | None = None
) -> Request:
    # prompt + P's first token
    req = Request(
        rid, list(range(num_prompt + 1)), SamplingParams(max_tokens=8), kv_transfer_params=params
    )
    if arrival_mono is not None:
        req.arrival_mono = arrival_mono
    return req


def meta(conn: NixlSchedulerSide):
    return conn.build_connector_meta(SchedulerOutput())


def finish_prefill(req: Request, status=RequestStatus.FINISHED_LENGTH_CAPPED) -> None:
    req.num_computed_tokens = req.num_prompt_tokens
    req.append_output_token(99)
    req.status = status


# ---- prefill side ---------------------------------------------------------------


def test_prefill_handoff_params_and_send_record():
    clock = Clock(500.0)
    conn = make(clock=clock)
    req = p_request("r1", 10)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    finish_prefill(req)
    delay, params = conn.request_finished(req, [5, 6, 2, 8])
    assert delay is True
    assert params == {  # no address: D looks "e0" epoch 7 up in its registry
        "do_remote_prefill": True,
        "remote_engine_id": "e0",
        "remote_block_ids": [5, 6, 2],  # ceil(10 / 4) blocks; the 4th holds no computed token
        "remote_request_id": "r1",
        "num_tokens": 10,
        "remote_epoch": 7,
        "lease_remaining_s": 60.0,
    }
    assert conn.has_pending_work() and conn.num_blocks_held_for_transfer == 3
    m = meta(conn)
    assert m.new_sends == [SendSpec("r1", 3, 560.0)]  # P's own monotonic clock
    assert meta(conn).is_empty()
    conn.update_connector_output(KVConnectorOutput(finished_sending=["r1"]))
    assert not conn.has_pending_work()
    conn.check_integrity()


def test_prefill_prompt_shorter_than_a_block_sends_one_block():
    conn = make()
    req = p_request("r1", 2)
    finish_prefill(req)
    _, params = conn.request_finished(req, [11])
    assert params["remote_block_ids"] == [11] and params["num_tokens"] == 2


@pytest.mark.parametrize(
    "status",
    [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR],
)
def test_prefill_finished_otherwise_holds_nothing(status):
    conn = make()
    req = p_request("r1", 10)
    finish_prefill(req, status)
    assert conn.request_finished(req, [1, 2, 3]) == (False, None)
    assert meta(conn).is_empty() and not conn.has_pending_work()


def test_plain_request_and_decode_role_hold_nothing():
    conn = make()
    req = p_request("r1", 10, params={})
    finish_prefill(req)
    assert conn.request_finished(req, [1, 2, 3]) == (False, None)
    decode_only = make(role="decode")
    req = p_request("r2", 10)
    finish_prefill(req)
    assert decode_only.request_finished(req, [1, 2, 3]) == (False, None)


def test_cancel_before_meta_drops_the_record():
    conn = make()
    req = p_request("r1", 8)
    finish_prefill(req)
    conn.request_finished(req, [1, 2])
    conn.cancel_send("r1")
    assert meta(conn).is_empty() and not conn.has_pending_work()
    conn.cancel_send("r1")  # idempotent
    conn.cancel_send("unknown")


def test_cancel_after_meta_tells_the_worker():
    conn = make()
    req = p_request("r1", 8)
    finish_prefill(req)
    conn.request_finished(req, [1, 2])
    assert len(meta(conn).new_sends) == 1
    conn.cancel_send("r1")
    assert meta(conn).cancelled_sends == ["r1"]
    assert not conn.has_pending_work()


def test_prefill_that_borrows_a_lent_prefix_reads_it_then_hands_off():
    # a peer's host tier lent 2 blocks (kvtransfer/tiers/export.py): P READs them, computes
    # the rest and holds the whole prompt for D
    conn = make(clock=Clock(500.0))
    lent = dict(d_params(8, [40, 41]), remote_medium="host", do_remote_decode=True)
    req = p_request("r1", 10, params=lent)
    assert conn.get_num_new_matched_tokens(req, 0) == (8, True)
    assert conn.loads_from_own_tiers(req)  # cached tokens, recomputed if the READ fails
    conn.update_state_after_alloc(req, [5, 6, 2], 8)
    (load,) = meta(conn).loads
    assert (load.local_block_ids, load.remote_block_ids, load.remote_medium) == (
        [5, 6],
        [40, 41],
        "host",
    )
    conn.update_connector_output(KVConnectorOutput(finished_recving=["r1"]))
    req.kv_transfer_params = {"do_remote_decode": True}  # as the scheduler leaves it loaded
    finish_prefill(req)
    delay, params = conn.request_finished(req, [5, 6, 2])
    assert delay is True and params["remote_block_ids"] == [5, 6, 2]
    assert params["num_tokens"] == 10 and "remote_medium" not in params  # P's device blocks
    assert meta(conn).new_sends == [SendSpec("r1", 3, 560.0)]
    conn.update_connector_output(KVConnectorOutput(finished_sending=["r1"]))
    conn.check_integrity()


def test_prefill_that_borrowed_and_is_aborted_before_its_read_tells_the_lender_done():
    conn = make()
    lent = dict(d_params(8, [40, 41]), remote_medium="host", do_remote_decode=True)
    req = p_request("r1", 10, params=lent)
    assert conn.get_num_new_matched_tokens(req, 0) == (8, True)
    finish_prefill(req, RequestStatus.FINISHED_ABORTED)
    assert conn.request_finished(req, []) == (False, None)  # nothing handed off
    (notify,) = meta(conn).notifies
    assert notify == NotifySpec("r1", PEER, "p-req", "done")  # the lender unpins at once
    conn.check_integrity()
    # aborted while still waiting, never considered by the scheduler: the same "done"
    req = p_request("r2", 10, params=lent)
    finish_prefill(req, RequestStatus.FINISHED_ABORTED)
    assert conn.request_finished(req, []) == (False, None)
    assert meta(conn).notifies == [NotifySpec("r2", PEER, "p-req", "done")]
    conn.check_integrity()


# ---- decode side ----------------------------------------------------------------


def test_decode_no_local_hit_loads_everything():
    conn = make()
    req = d_request("d1", 10, d_params(10, [20, 21, 22]))
    assert conn.get_num_new_matched_tokens(req, 0) == (10, True)
    assert conn.get_num_new_matched_tokens(req, 0) == (10, True)  # idempotent
    conn.update_state_after_alloc(req, [4, 5, 6], 10)
    m = meta(conn)
    assert len(m.loads) == 1
    load = m.loads[0]
    assert load == LoadSpec("d1", PEER, "p-req", [4, 5, 6], [20, 21, 22], load.lease_deadline_mono)
    assert conn.has_pending_work()
    # after the load the connector offers nothing more (e.g. after a preemption)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_connector_output(KVConnectorOutput(finished_recving=["d1"]))
    req.status = RequestStatus.FINISHED_STOPPED
    assert conn.request_finished(req, [4, 5, 6]) == (False, None)
    assert meta(conn).is_empty() and not conn.has_pending_work()
    conn.check_integrity()


def test_decode_partial_local_hit_reads_trailing_blocks_only():
    conn = make()
    req = d_request("d1", 10, d_params(10, [20, 21, 22]))
    assert conn.get_num_new_matched_tokens(req, 8) == (2, True)
    conn.update_state_after_alloc(req, [4, 5, 6, 7], 2)
    (load,) = meta(conn).loads
    assert (load.local_block_ids, load.remote_block_ids) == ([6], [22])


def test_decode_partial_last_block_included():
    conn = make()
    req = d_request("d1", 9, d_params(9, [20, 21, 22]))
    assert conn.get_num_new_matched_tokens(req, 4) == (5, True)
    conn.update_state_after_alloc(req, [4, 5, 6], 5)
    (load,) = meta(conn).loads
    assert (load.local_block_ids, load.remote_block_ids) == ([5, 6], [21, 22])


def test_decode_full_local_hit_only_notifies():
    conn = make()
    req = d_request("d1", 8, d_params(8, [20, 21]))
    assert conn.get_num_new_matched_tokens(req, 8) == (0, False)
    conn.update_state_after_alloc(req, [4, 5, 6], 0)
    m = meta(conn)
    assert m.loads == [] and m.notifies == [NotifySpec("d1", PEER, "p-req", "done")]
    req.status = RequestStatus.FINISHED_STOPPED
    conn.request_finished(req, [4, 5, 6])
    assert meta(conn).is_empty()  # not notified twice
    conn.check_integrity()


def test_decode_keeps_one_token_to_compute():
    conn = make()
    # P computed all 8 tokens, D's request is exactly those 8 tokens (no first token)
    req = Request("d1", list(range(8)), SamplingParams(), kv_transfer_params=d_params(8, [20, 21]))
    assert conn.get_num_new_matched_tokens(req, 0) == (7, True)


def test_decode_abort_before_alloc_notifies_peer():
    conn = make()
    req = d_request("d1", 10, d_params(10, [20, 21, 22]))
    conn.get_num_new_matched_tokens(req, 0)
    req.status = RequestStatus.FINISHED_ABORTED
    assert conn.request_finished(req, []) == (False, None)
    assert meta(conn).notifies == [NotifySpec("d1", PEER, "p-req", "done")]
    conn.check_integrity()


def test_decode_abort_during_load_keeps_load_in_flight():
    conn = make()
    req = d_request("d1", 10, d_params(10, [20, 21, 22]))
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, [1, 2, 3], 10)
    meta(conn)
    req.status = RequestStatus.FINISHED_ABORTED
    assert conn.request_finished(req, [1, 2, 3]) == (False, None)
    assert meta(conn).is_empty()
    assert conn.has_pending_work()  # until the worker reports the read finished
    conn.update_connector_output(KVConnectorOutput(finished_recving=["d1"]))
    conn.check_integrity()


def test_decode_invalid_params_compute_locally():
    conn = make()
    bad = {**d_params(10, [20]), "num_tokens": "x"}
    req = d_request("d1", 10, bad)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, [1, 2, 3], 0)
    req.status = RequestStatus.FINISHED_STOPPED
    conn.request_finished(req, [1, 2, 3])
    assert meta(conn).is_empty()
    conn.check_integrity()


def test_decode_too_few_remote_blocks_computes_locally_and_frees_peer():
    conn = make()
    req = d_request("d1", 10, d_params(10, [20, 21]))  # 10 tokens need 3 blocks of 4
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, [1, 2, 3], 0)
    assert meta(conn).notifies == [NotifySpec("d1", PEER, "p-req", "done")]


def test_decode_expired_lease_makes_a_failing_load():
    clock = Clock()
    conn = make(clock=clock)
    req = d_request("d1", 10, d_params(10, [20, 21, 22], remaining_s=5.0), clock.now)
    clock.now += 5.0 - 2.0  # 2 s left by D's count, within the safety margin
    assert conn.get_num_new_matched_tokens(req, 0) == (10, True)
    conn.update_state_after_alloc(req, [1, 2, 3], 10)
    (load,) = meta(conn).loads
    assert "lease expired" in load.error
    assert (load.local_block_ids, load.remote_block_ids) == ([1, 2, 3], [])  # all load errors


def test_decode_renews_lease_while_waiting_for_blocks():
    clock = Clock()
    conn = make(lease_s=3.0, clock=clock)
    # 2 s of P's lease left on arrival (P sent it 1 s ago): a renewal is due (every 1 s)
    req = d_request("d1", 10, d_params(10, [20, 21, 22], remaining_s=2.0), clock.now)
    conn.get_num_new_matched_tokens(req, 0)
    m = meta(conn)
    assert m.notifies == [NotifySpec("d1", PEER, "p-req", "renew")]
    assert meta(conn).notifies == []  # not again before lease_s / 3
    conn.update_state_after_alloc(req, [1, 2, 3], 10)
    (load,) = meta(conn).loads
    assert load.lease_deadline_mono == clock.now + 3.0  # the renewal counted


def test_decode_late_renewal_does_not_extend_known_deadline():
    clock = Clock()
    conn = make(lease_s=3.0, clock=clock)
    # 1.25 s left minus the 0.75 s margin = 0.5 s: less than the renewal margin
    req = d_request("d1", 10, d_params(10, [20, 21, 22], remaining_s=1.25), clock.now)
    conn.get_num_new_matched_tokens(req, 0)
    assert meta(conn).notifies[0].kind == "renew"
    conn.update_state_after_alloc(req, [1, 2, 3], 10)
    (load,) = meta(conn).loads
    assert load.lease_deadline_mono == clock.now + 0.5


def test_unregistered_prefill_engine_or_epoch_is_a_load_error():
    conn = make()
    for rid, patch in (("d1", {"remote_engine_id": "evil"}), ("d2", {"remote_epoch": 4})):
        req = d_request(rid, 10, {**d_params(10, [20, 21, 22]), **patch})
        assert conn.get_num_new_matched_tokens(req, 0) == (10, True)
        conn.update_state_after_alloc(req, [1, 2, 3], 10)
        (load,) = meta(conn).loads
        assert load.local_block_ids == [1, 2, 3] and load.remote_block_ids == []
        assert load.peer.host == ""  # nothing to connect to
        assert "not registered" in load.error or "not its registered epoch" in load.error
        conn.update_connector_output(KVConnectorOutput(finished_recving=[rid]))
        req.status = RequestStatus.FINISHED_ERROR
        conn.request_finished(req, [1, 2, 3])
        assert meta(conn).is_empty()  # no notification to an unregistered engine
    conn.check_integrity()
    with pytest.raises(ValueError, match="port"):
        conn.set_prefill_endpoints([["p0", 3, "10.0.0.1", 0]])


def test_prefill_only_role_ignores_remote_prefill():
    conn = make(role="prefill")
    req = d_request("d1", 10, d_params(10, [20, 21, 22]))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, [1, 2, 3], 0)
    assert meta(conn).is_empty()
