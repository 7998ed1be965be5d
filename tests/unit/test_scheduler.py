import zlib

import pytest

from tandem.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from tandem.wire.engine_protocol import FinishReason, SamplingParams
from tests.unit.fakes import FakeRunner, step


def make(**kw):
    cfg = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=64)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def add(s, rid, n, eos=None, priority=0, arrival=None, **sp):
    # token ids from a stable hash of the id: Python's str hash changes per process, and two
    # of them equal mod 1000 made prompts share blocks (a prefix hit) in a rare run
    sp.setdefault("max_tokens", 4)
    base = 1000 + zlib.crc32(rid.encode()) % 1000
    r = Request(
        rid,
        [base + i for i in range(n)] if n else [],
        SamplingParams(**sp),
        eos_token_id=eos,
        priority=priority,
        arrival_time=arrival,
    )
    s.add_request(r)
    return r


def run_to_end(s, runner, max_steps=200):
    outs = {}
    for _ in range(max_steps):
        if not s.has_work():
            break
        so, eo = step(s, runner)
        for o in eo.outputs:
            outs.setdefault(o.request_id, []).append(o)
    assert not s.has_work()
    s.check_integrity()
    return outs


def test_token_counts_per_step_chunked_prefill():
    s = make()
    r = FakeRunner()
    add(s, "a", 10, max_tokens=3)
    add(s, "b", 20, max_tokens=2)
    steps = [step(s, r)[0].num_scheduled_tokens for _ in range(4)]
    assert steps == [{"a": 10, "b": 6}, {"a": 1, "b": 14}, {"a": 1, "b": 1}, {}]
    s.check_integrity()


def test_prompt_tokens_count_every_chunk_and_no_hit():
    # "b" is chunked over two steps: both chunks are computed prompt tokens
    # (the counter once kept only the first chunk); a prefix hit is not.
    s = make()
    r = FakeRunner()
    add(s, "a", 10, max_tokens=3)
    add(s, "b", 20, max_tokens=2)
    run_to_end(s, r)
    assert s.make_stats().num_prompt_tokens == 30
    c = Request("c", list(range(12)), SamplingParams(max_tokens=1))
    d = Request("d", list(range(12)) + [5, 6], SamplingParams(max_tokens=1))
    s.add_request(c)
    run_to_end(s, r)
    s.add_request(d)
    run_to_end(s, r)
    assert s.make_stats().num_prompt_tokens == 30 + 12 + 2


def test_long_prefill_threshold_and_max_num_seqs():
    s = make(long_prefill_token_threshold=5, max_num_seqs=2)
    r = FakeRunner()
    add(s, "a", 12)
    add(s, "b", 3)
    add(s, "c", 3)
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 5, "b": 1}
    assert s.get_request_counts() == (2, 1)
    run_to_end(s, r)


def test_no_chunked_prefill_waits_for_budget():
    s = make(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    r = FakeRunner()
    add(s, "a", 40)
    add(s, "b", 30)
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 40}
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 1, "b": 30}
    run_to_end(s, r)


def test_prefix_hit_counted_and_blocks_shared():
    s = make()
    r = FakeRunner()
    a = Request("a", list(range(12)), SamplingParams(max_tokens=2))
    b = Request("b", list(range(12)) + [77], SamplingParams(max_tokens=2))
    s.add_request(a)
    step(s, r)
    s.add_request(b)
    so, _ = step(s, r)
    nb = so.scheduled_new_reqs[0]
    assert nb.num_computed_tokens == 12 and so.num_scheduled_tokens["b"] == 1
    assert nb.block_ids[:3] == [0, 1, 2]  # a's blocks (a finished this step)
    st = s.make_stats()
    assert st.prefix_cache_queries == 12 + 13 and st.prefix_cache_hits == 12
    assert b.num_cached_tokens == 12
    run_to_end(s, r)


def test_stop_conditions():
    s = make()
    r = FakeRunner(next_token=lambda rid, pos: {"eos": 2, "stopid": 5, "minstop": 2}.get(rid, 9))
    add(s, "eos", 3, eos=2, max_tokens=5)
    add(s, "ign", 3, eos=9, ignore_eos=True, max_tokens=3)
    add(s, "stopid", 3, stop_token_ids=[5], max_tokens=5)
    add(s, "minstop", 3, eos=2, min_tokens=2, max_tokens=5)
    add(s, "len", 3, max_tokens=2)
    outs = run_to_end(s, r)
    toks = {k: sum((o.new_token_ids for o in v), []) for k, v in outs.items()}
    reasons = {k: v[-1].finish_reason for k, v in outs.items()}
    assert toks == {"eos": [2], "ign": [9, 9, 9], "stopid": [5], "minstop": [2, 2], "len": [9, 9]}
    assert reasons == {
        "eos": FinishReason.STOP,
        "ign": FinishReason.LENGTH,
        "stopid": FinishReason.STOP,
        "minstop": FinishReason.STOP,
        "len": FinishReason.LENGTH,
    }
    assert outs["stopid"][-1].stop_reason == 5


def test_max_model_len_caps():
    s = make(max_model_len=8)
    r = FakeRunner()
    add(s, "a", 6, max_tokens=100)
    outs = run_to_end(s, r)
    assert sum(len(o.new_token_ids) for o in outs["a"]) == 2
    assert outs["a"][-1].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "prompt_token_ids"),
        (dict(n=64), "max_model_len"),
        (dict(n=3, max_tokens=0), "max_tokens"),
        (dict(n=3, temperature=-1.0), "temperature"),
        (dict(n=3, top_p=0.0), "top_p"),
        (dict(n=3, top_p=1.5), "top_p"),
        (dict(n=3, min_tokens=9, max_tokens=2), "min_tokens"),
    ],
)
def test_bad_input_names_field(kwargs, field):
    s = make()
    n = kwargs.pop("n")
    with pytest.raises(ValueError, match=field):
        add(s, "x", n, **kwargs)
    s.check_integrity()


def test_duplicate_id_rejected_and_unknown_abort_noop():
    s = make()
    add(s, "a", 3)
    with pytest.raises(ValueError, match="request_id"):
        add(s, "a", 3)
    s.finish_requests("nope", RequestStatus.FINISHED_ABORTED)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # idempotent
    s.check_integrity()


def test_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(block_size=0)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(num_kv_blocks=2, block_size=4, max_model_len=64)


def test_preemption_fcfs_newest_first_and_resume():
    # 6 blocks of 4 tokens: a and b (8-token prompts) fit, decoding forces preemption.
    s = make(num_kv_blocks=6, max_model_len=24, max_num_batched_tokens=32)
    r = FakeRunner()
    a = add(s, "a", 8, max_tokens=12)
    b = add(s, "b", 8, max_tokens=12)
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    seen_preempt = []
    for _ in range(40):
        so, _ = step(s, r)
        seen_preempt += so.preempted_req_ids
        if seen_preempt:
            break
    assert seen_preempt == ["b"]  # newest goes first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    outs = run_to_end(s, r)
    assert outs["b"][-1].finish_reason == FinishReason.LENGTH
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert s.make_stats().num_preemptions >= 1


def test_preemption_priority_lowest_priority_first():
    s = make(num_kv_blocks=6, max_model_len=24, max_num_batched_tokens=32, policy="priority")
    r = FakeRunner()
    add(s, "low", 8, priority=5, arrival=1.0, max_tokens=12)
    add(s, "high", 8, priority=0, arrival=2.0, max_tokens=12)
    so, _ = step(s, r)
    assert set(so.num_scheduled_tokens) == {"low", "high"}
    pre = []
    for _ in range(40):
        so, _ = step(s, r)
        pre += so.preempted_req_ids
        if pre:
            break
    assert pre == ["low"]
    # the preempted request was not computed in the step that preempted it
    assert "low" not in so.num_scheduled_tokens
    run_to_end(s, r)


def test_priority_queue_admits_by_priority():
    s = make(policy="priority", max_num_seqs=1)
    r = FakeRunner()
    add(s, "late", 3, priority=9, arrival=1.0, max_tokens=1)
    add(s, "urgent", 3, priority=0, arrival=2.0, max_tokens=1)
    so, _ = step(s, r)
    assert list(so.num_scheduled_tokens) == ["urgent"]
    run_to_end(s, r)


@pytest.mark.parametrize("state", ["waiting", "running", "preempted", "finished"])
def test_abort_in_every_local_state(state):
    s = make(num_kv_blocks=6, max_model_len=24, max_num_batched_tokens=32)
    r = FakeRunner()
    a = add(s, "a", 8, max_tokens=12)
    b = add(s, "b", 8, max_tokens=12)
    if state == "running":
        step(s, r)
        assert b.status == RequestStatus.RUNNING
    elif state == "preempted":
        while b.status != RequestStatus.PREEMPTED:
            step(s, r)
    elif state == "finished":
        run_to_end(s, r)
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    s.check_integrity(idle=False)
    so, _ = step(s, r)
    if state == "running":
        assert "b" in so.finished_req_ids
    assert "b" not in so.num_scheduled_tokens
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    step(s, r)
    assert a.is_finished
    s.check_integrity()
