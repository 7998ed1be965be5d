"""Connector hooks: remote KV loads (decode side) and held blocks (prefill side)."""

from tandem.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from tandem.scheduler.messages import KVConnectorOutput
from tandem.wire.engine_protocol import FinishReason, SamplingParams
from tests.unit.fakes import FakeConnector, FakeRunner, step


def make(policy="recompute", **kw):
    cfg = dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=32, max_model_len=64)
    cfg.update(kw)
    conn = FakeConnector()
    return Scheduler(SchedulerConfig(load_failure_policy=policy, **cfg), conn), conn


def remote(rid, n, remote_tokens, **sp):
    sp.setdefault("max_tokens", 3)
    return Request(
        rid,
        list(range(n)),
        SamplingParams(**sp),
        kv_transfer_params={"remote_tokens": remote_tokens},
    )


def test_remote_load_waits_then_runs_with_exact_computed_tokens():
    s, conn = make()
    r = FakeRunner()
    d = remote("d", 11, 10)  # prompt + P's first token; P computed 10
    other = Request("o", [50, 51, 52], SamplingParams(max_tokens=3))
    s.add_request(d)
    s.add_request(other)
    so, _ = step(s, r)
    assert d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [a for a in conn.allocs if a[0] == "d"] == [("d", [0, 1, 2], 10)]
    assert so.num_scheduled_tokens == {"o": 3}  # others keep running
    assert so.kv_connector_metadata == {"step": 1}
    # blocks being filled are not published: an identical prompt gets no hit
    probe = Request("p", list(range(11)), SamplingParams())
    assert s.kv.get_computed_blocks(probe) == ([], 0)
    so, _ = step(s, r)
    assert "d" not in so.num_scheduled_tokens
    r.kv_output = KVConnectorOutput(finished_recving=["d"])
    step(s, r)
    # KV landed: it joins the running set at once (it holds blocks, so it must
    # be preemptable) and the runner sees it as new on its next step
    assert d.status == RequestStatus.RUNNING and d.num_computed_tokens == 10
    hits, n = s.kv.get_computed_blocks(probe)  # now published
    assert n == 8 and [b.block_id for b in hits] == [0, 1]
    so, _ = step(s, r)
    assert so.num_scheduled_tokens["d"] == 1  # only P's first token is computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 10
    for _ in range(10):
        if not s.has_work():
            break
        step(s, r)
    assert d.num_output_tokens == 3
    s.check_integrity()


def test_local_prefix_hit_reduces_external_tokens():
    s, conn = make()
    r = FakeRunner()
    warm = Request("w", list(range(9)), SamplingParams(max_tokens=1))
    s.add_request(warm)
    step(s, r)  # finishes, its 2 full blocks stay cached
    d = remote("d", 11, 10)
    s.add_request(d)
    step(s, r)
    # 8 local (w's blocks 0, 1) + 2 external into a new block: w's partial
    # block 2 holds no hash and continues the run after block 1
    assert conn.allocs[-1] == ("d", [0, 1, 2], 2)
    r.kv_output = KVConnectorOutput(finished_recving=["d"])
    step(s, r)
    assert d.num_computed_tokens == 10
    while s.has_work():
        step(s, r)
    s.check_integrity()


def test_full_local_hit_reads_nothing():
    s, conn = make()
    r = FakeRunner()
    s.add_request(Request("w", list(range(13)), SamplingParams(max_tokens=1)))
    step(s, r)
    d = remote("d", 9, 8)
    s.add_request(d)
    so, _ = step(s, r)
    # w's 3 full blocks are cached, but d (9 tokens) can hit at most 2 of them;
    # its new block is the lowest uncached free one (w's partial block 3), so
    # w's cached block 2 survives
    assert conn.allocs[-1] == ("d", [0, 1, 3], 0)  # notify-only
    assert d.status == RequestStatus.RUNNING and so.num_scheduled_tokens["d"] == 1
    while s.has_work():
        step(s, r)
    s.check_integrity()


def test_too_few_blocks_waits_without_starting_a_read():
    s, conn = make(num_kv_blocks=4, max_model_len=16)
    r = FakeRunner()
    hog = Request("hog", list(range(100, 112)), SamplingParams(max_tokens=2))
    s.add_request(hog)
    step(s, r)  # hog holds 3 of 4 blocks (and needs its 4th next)
    d = remote("d", 9, 8)
    s.add_request(d)
    step(s, r)
    d_allocs = lambda: [a for a in conn.allocs if a[0] == "d"]  # noqa: E731
    assert d.status == RequestStatus.WAITING and d_allocs() == []
    while hog.status == RequestStatus.RUNNING:
        step(s, r)
    step(s, r)
    assert d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d_allocs() == [("d", [3, 2], 8)]  # blocks for the 8 remote tokens only
    r.kv_output = KVConnectorOutput(finished_recving=["d"])
    while s.has_work():
        step(s, r)
    s.check_integrity()


def test_load_error_recompute_policy():
    s, _ = make()
    r = FakeRunner()
    d = remote("d", 11, 10)
    s.add_request(d)
    step(s, r)
    blocks = s.kv.get_block_ids("d")
    r.kv_output = KVConnectorOutput(finished_recving=["d"], invalid_block_ids=[blocks[1]])
    step(s, r)
    assert d.status == RequestStatus.RUNNING and d.num_computed_tokens == 4
    so, _ = step(s, r)
    assert so.num_scheduled_tokens["d"] == 7  # recompute from the first bad block
    while s.has_work():
        step(s, r)
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED
    s.check_integrity()


def test_load_error_fail_policy():
    s, _ = make(policy="fail")
    r = FakeRunner()
    d = remote("d", 11, 10)
    s.add_request(d)
    step(s, r)
    r.kv_output = KVConnectorOutput(
        finished_recving=["d"], invalid_block_ids=s.kv.get_block_ids("d")
    )
    _, eo = step(s, r)
    (o,) = eo.outputs
    assert o.finish_reason == FinishReason.ERROR and "remote KV" in o.error
    assert d.status == RequestStatus.FINISHED_ERROR
    s.check_integrity()


def test_abort_while_waiting_for_remote_frees_after_read():
    s, conn = make()
    r = FakeRunner()
    d = remote("d", 11, 10)
    s.add_request(d)
    step(s, r)
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert conn.finished == ["d"]
    assert s.kv.get_block_ids("d") == [0, 1, 2]  # NIXL still writes into them
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)  # idempotent
    r.kv_output = KVConnectorOutput(finished_recving=["d"])
    step(s, r)
    s.check_integrity()


def test_preempted_after_read_recomputes_locally():
    s, conn = make(num_kv_blocks=5, max_model_len=20)
    r = FakeRunner()
    d = remote("d", 9, 8, max_tokens=6)
    s.add_request(d)
    a = Request("a", list(range(100, 108)), SamplingParams(max_tokens=10))
    s.add_request(a)
    step(s, r)  # d: 3 blocks, waiting for its read; a: 2 blocks, running
    r.kv_output = KVConnectorOutput(finished_recving=["d"])
    preempted = []
    for _ in range(40):
        if not s.has_work():
            break
        so, _ = step(s, r)
        preempted += so.preempted_req_ids
    assert "d" in preempted
    assert d.kv_transfer_params is None  # no second remote read
    assert [a for a in conn.allocs if a[2] > 0] == [("d", [0, 1], 8)]
    assert d.num_output_tokens == 6 and a.num_output_tokens == 10
    s.check_integrity()


def test_prefill_side_holds_blocks_until_sent():
    s, conn = make()
    r = FakeRunner()
    p = Request(
        "p", list(range(3)), SamplingParams(max_tokens=1), kv_transfer_params={"hold": True}
    )
    s.add_request(p)
    _, eo = step(s, r)
    (o,) = eo.outputs
    assert o.finish_reason == FinishReason.LENGTH
    assert o.kv_transfer_params == {"block_ids": [0]}  # a short prompt still sends its block
    assert s.num_blocks_held_for_transfer() == 1 and s.has_work()
    s.check_integrity(idle=False)
    step(s, r)
    assert s.kv.get_block_ids("p") == [0]
    r.kv_output = KVConnectorOutput(finished_sending=["p"])
    step(s, r)
    s.check_integrity()


def test_abort_of_held_request_frees_at_once():
    s, conn = make()
    r = FakeRunner()
    p = Request(
        "p", list(range(6)), SamplingParams(max_tokens=1), kv_transfer_params={"hold": True}
    )
    s.add_request(p)
    step(s, r)
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert conn.cancelled == ["p"]
    s.check_integrity()
    r.kv_output = KVConnectorOutput(finished_sending=["p"])  # late report is ignored
    step(s, r)
    s.check_integrity()
