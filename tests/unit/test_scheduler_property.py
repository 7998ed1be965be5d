"""Property tests: random workloads on tiny KV pools keep every invariant."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from tandem.scheduler.messages import KVConnectorOutput
from tandem.wire.engine_protocol import SamplingParams
from tests.unit.fakes import FakeConnector, FakeRunner

request_st = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 30),
        "max_tokens": st.integers(1, 12),
        "shared_prefix": st.booleans(),
        "arrive_at": st.integers(0, 15),
        "abort_at": st.one_of(st.none(), st.integers(0, 20)),
        "load_steps": st.integers(1, 4),
        "priority": st.integers(0, 3),
        "remote": st.sampled_from([None, "ok", "fail", "hold"]),
        "salt": st.sampled_from([None, "a", "b"]),
        "n": st.sampled_from([1, 1, 3]),
    }
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=12),
    num_blocks=st.integers(16, 24),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(4, 40),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority", "prefill-first"]),
    margin=st.sampled_from([0.0, 0.1, 0.3]),
    max_partial=st.integers(0, 3),
    max_long=st.integers(0, 2),
    chunked=st.booleans(),
    threshold=st.sampled_from([0, 3]),
    fail_policy=st.sampled_from(["recompute", "fail"]),
    hash_algo=st.sampled_from(["sha256", "builtin"]),
)
def test_random_workload_invariants(
    reqs,
    num_blocks,
    block_size,
    budget,
    max_seqs,
    policy,
    margin,
    max_partial,
    max_long,
    chunked,
    threshold,
    fail_policy,
    hash_algo,
):
    max_model_len = 32
    if not chunked:
        budget = max(budget, max_model_len)
    cfg = SchedulerConfig(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_model_len,
        policy=policy,
        kv_admission_margin=margin,
        max_num_partial_prefills=max_partial,
        max_long_partial_prefills=max_long if threshold else 0,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
        load_failure_policy=fail_policy,
        prefix_caching_hash_algo=hash_algo,
    )
    conn = FakeConnector()
    s = Scheduler(cfg, conn)
    runner = FakeRunner(next_token=lambda rid, pos: 3 + pos % 5)
    pending = sorted(enumerate(reqs), key=lambda x: x[1]["arrive_at"])
    added: dict[str, dict] = {}
    load_started: dict[str, int] = {}
    for t in range(400):
        while pending and pending[0][1]["arrive_at"] <= t:
            i, spec = pending.pop(0)
            n = min(spec["prompt_len"], max_model_len - 1)
            base = [1] * 6 if spec["shared_prefix"] else [100 + i] * 6
            tokens = (base + list(range(200 + i * 40, 240 + i * 40)))[:n]
            params = None
            if spec["remote"] in ("ok", "fail"):
                params = {"remote_tokens": max(0, n - 1)}
            elif spec["remote"] == "hold":
                params = {"hold": True}
            rid = f"r{i}"
            s.add_request(
                Request(
                    rid,
                    tokens,
                    SamplingParams(max_tokens=spec["max_tokens"]),
                    priority=spec["priority"],
                    arrival_time=float(t) + i * 1e-3,
                    kv_transfer_params=params,
                    cache_salt=spec["salt"],
                    n=spec["n"],
                )
            )
            added[rid] = spec
        for rid, spec in added.items():
            if spec["abort_at"] == t:
                s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        if not pending and not s.has_work():
            break
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= budget
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert len(s.running) <= max_seqs
        assert len(so.num_scheduled_tokens) <= max_seqs
        # the fake "worker side": a load takes load_steps steps, sends are
        # acknowledged every other step
        for r in s.waiting_for_remote:
            load_started.setdefault(r, t)
        done = [r for r in s.waiting_for_remote if t - load_started[r] >= added[r]["load_steps"]]
        kv_out = KVConnectorOutput(
            finished_recving=done,
            invalid_block_ids=[
                b for r in done if added[r]["remote"] == "fail" for b in s.kv.get_block_ids(r)[-1:]
            ],
            finished_sending=[r for r in s.held_for_send if t % 2 == 0],
        )
        runner.kv_output = kv_out
        s.update_from_output(so, runner.execute(so))
        s.check_integrity(idle=False)
        # no block has two owners unless it is a shared cached block
        owners: dict[int, int] = {}
        salts: dict[int, set] = {}
        families: dict[int, set] = {}
        for rid, blocks in s.kv.req_blocks.items():
            family = s.requests[rid].parent_id or rid  # a fork child: its parent's
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
                salts.setdefault(b.block_id, set()).add(added[family]["salt"])
                families.setdefault(b.block_id, set()).add(family)
        for bid, num_owners in owners.items():
            # shared across requests: a cached block; within one fork: its full blocks
            assert num_owners == s.kv.pool.blocks[bid].ref_cnt
            if len(families[bid]) > 1:
                assert s.kv.pool.blocks[bid].block_hash is not None
                assert len(salts[bid]) == 1, f"block {bid} shared by salts {salts[bid]}"
        # a hashed block sits in a request's table only under the request's
        # own hash at that position (its salt and prefix): tenants never mix
        for rid, blocks in s.kv.req_blocks.items():
            hashes = s.requests[rid].block_hashes
            for i, b in enumerate(blocks):
                if b.block_hash is not None:
                    assert i < len(hashes) and hashes[i] == b.block_hash, (rid, i, b)
    assert not pending and not s.has_work(), "workload did not drain within 400 steps"
    s.check_integrity()
