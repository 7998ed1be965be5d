"""Scheduling policies and admission limits (scheduler/policies.py), exact outcomes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.scheduler import SchedulerConfig
from tests.unit.fakes import FakeRunner, step
from tests.unit.test_scheduler import add, make, run_to_end


def test_prefill_first_serves_a_running_prefill_before_decodes():
    def run(policy):
        s = make(max_num_batched_tokens=8, policy=policy)
        r = FakeRunner()
        for k in range(6):
            add(s, f"d{k}", 1, max_tokens=20, arrival=float(k))
        step(s, r)  # six one-token prompts: all decode from now on
        add(s, "p", 40, max_tokens=2, arrival=10.0)
        step(s, r)  # p admitted behind the decodes: a 2-token chunk
        so, _ = step(s, r)
        counts = dict(so.num_scheduled_tokens)
        run_to_end(s, r)
        return counts

    fcfs = run("fcfs")
    assert fcfs["p"] == 2 and all(fcfs[f"d{k}"] == 1 for k in range(6))
    first = run("prefill-first")
    assert first == {"p": 8}  # the prefill takes the short budget, decodes wait a step


def test_priority_arrival_preempts_the_worst_running_request():
    s = make(policy="priority", max_num_seqs=2)
    r = FakeRunner()
    low = add(s, "low", 4, priority=5, arrival=1.0, max_tokens=30)
    mid = add(s, "mid", 4, priority=3, arrival=2.0, max_tokens=30)
    step(s, r)
    step(s, r)
    add(s, "high", 4, priority=0, arrival=3.0, max_tokens=2)
    so, _ = step(s, r)
    assert so.preempted_req_ids == ["low"]
    assert "high" in so.num_scheduled_tokens and "mid" in so.num_scheduled_tokens
    assert low.num_preemptions == 1 and mid.num_preemptions == 0
    s.check_integrity(idle=False)
    # an arrival never preempts an equal or better priority
    add(s, "equal", 4, priority=3, arrival=4.0, max_tokens=2)
    so, _ = step(s, r)
    assert so.preempted_req_ids == []
    run_to_end(s, r)


def test_fcfs_never_preempts_on_arrival():
    s = make(max_num_seqs=1)
    r = FakeRunner()
    add(s, "a", 4, priority=5, max_tokens=6)
    step(s, r)
    add(s, "b", 4, priority=0, max_tokens=2)
    so, _ = step(s, r)
    assert so.preempted_req_ids == [] and list(so.num_scheduled_tokens) == ["a"]
    run_to_end(s, r)


def test_admission_margin_keeps_blocks_free():
    # 20 blocks of 4 tokens; each prompt of 12 tokens takes 3 blocks (+1 to decode)
    def admitted(margin):
        s = make(num_kv_blocks=20, max_num_batched_tokens=200, kv_admission_margin=margin)
        r = FakeRunner()
        for k in range(6):
            add(s, f"r{k}", 12, max_tokens=4, arrival=float(k))
        so, _ = step(s, r)
        n = len(so.num_scheduled_tokens)
        free = s.kv.num_free_blocks
        run_to_end(s, r)
        return n, free

    assert admitted(0.0) == (6, 2)
    n, free = admitted(0.25)  # 5 blocks kept free
    assert n == 5 and free == 5


def test_admission_margin_admits_a_lone_request():
    s = make(num_kv_blocks=20, max_model_len=64, kv_admission_margin=0.9)
    r = FakeRunner()
    add(s, "big", 40, max_tokens=2)
    so, _ = step(s, r)
    assert list(so.num_scheduled_tokens) == ["big"]
    run_to_end(s, r)


def test_short_prompts_overtake_a_long_one_at_its_limit():
    s = make(
        max_num_batched_tokens=24,
        long_prefill_token_threshold=8,
        max_long_partial_prefills=1,
        max_num_partial_prefills=3,
    )
    r = FakeRunner()
    add(s, "long1", 40, max_tokens=2, arrival=1.0)
    add(s, "long2", 40, max_tokens=2, arrival=2.0)
    add(s, "short", 6, max_tokens=2, arrival=3.0)
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"long1": 8, "short": 6}
    assert [q.request_id for q in s.waiting] == ["long2"]  # kept its place at the head
    run_to_end(s, r)


def test_max_num_partial_prefills_caps_prefills_per_step():
    s = make(max_num_batched_tokens=64, max_num_partial_prefills=1)
    r = FakeRunner()
    add(s, "a", 10, max_tokens=3, arrival=1.0)
    add(s, "b", 10, max_tokens=3, arrival=2.0)
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 10}
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}  # a decodes now
    run_to_end(s, r)


@settings(max_examples=30, deadline=None)
@given(
    threshold=st.integers(2, 8),
    extra_len=st.integers(1, 60),
    extra_budget=st.integers(8, 24),
    short_len=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "prefill-first"]),
)
def test_long_prefill_is_not_starved_by_a_stream_of_short_prompts(
    threshold, extra_len, extra_budget, short_len, policy
):
    """A long prompt behind another long one, one short prompt arriving every
    step forever: the second long prompt starts as soon as the first is no
    longer long (at most ceil(long_len / threshold) steps)."""
    long_len = threshold + extra_len
    s = make(
        num_kv_blocks=1024,
        max_model_len=128,
        max_num_batched_tokens=threshold + extra_budget,
        long_prefill_token_threshold=threshold,
        max_long_partial_prefills=1,
        policy=policy,
    )
    r = FakeRunner()
    add(s, "long1", long_len, max_tokens=2, arrival=0.0)
    add(s, "long2", long_len, max_tokens=2, arrival=0.5)
    bound = -(-long_len // threshold)
    for t in range(bound + 1):
        add(s, f"s{t}", short_len, max_tokens=2, arrival=1.0 + t)
        so, _ = step(s, r)
        s.check_integrity(idle=False)
        if "long2" in so.num_scheduled_tokens:
            break
    else:
        raise AssertionError(f"long2 not started within {bound + 1} steps")
    run_to_end(s, r, max_steps=500)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"policy": "lifo"}, "policy"),
        ({"kv_admission_margin": 1.0}, "kv_admission_margin"),
        ({"kv_admission_margin": -0.1}, "kv_admission_margin"),
        ({"max_num_partial_prefills": -1}, "max_num_partial_prefills"),
        ({"max_long_partial_prefills": 1}, "long_prefill_token_threshold"),
    ],
)
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kw)
