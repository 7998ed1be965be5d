"""AsyncScheduler: output placeholders let step N+1 be scheduled before step N's output."""

from __future__ import annotations

from tandem.scheduler import Request, RequestStatus, SchedulerConfig
from tandem.scheduler.async_scheduler import AsyncScheduler
from tandem.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from tandem.wire.engine_protocol import FinishReason, SamplingParams


def make(**kw) -> AsyncScheduler:
    cfg = dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=16, max_model_len=64)
    cfg.update(kw)
    return AsyncScheduler(SchedulerConfig(**cfg))


def add(s: AsyncScheduler, rid: str, n: int, **sp) -> Request:
    r = Request(rid, list(range(100, 100 + n)), SamplingParams(**sp))
    s.add_request(r)
    return r


def output(so: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    """The runner's output for ``so``: ``tokens[rid]`` for the requests that sample."""
    out = ModelRunnerOutput()
    for rid in so.num_scheduled_tokens:
        out.req_ids.append(rid)
        out.sampled_token_ids.append([tokens[rid]] if rid in tokens else [])
    return out


def test_scheduled_ahead_but_never_past_max_tokens():
    s = make()
    a = add(s, "a", 5, max_tokens=2)
    so1 = s.schedule()  # prefill: samples token 1
    assert so1.num_scheduled_tokens == {"a": 5} and a.num_output_placeholders == 1
    so2 = s.schedule()  # before step 1's output: decodes the placeholder, samples token 2
    assert so2.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    so3 = s.schedule()  # token 2 is its last: nothing more, although nothing is known yet
    assert so3.num_scheduled_tokens == {}
    s.check_integrity(idle=False)
    assert s.update_from_output(so1, output(so1, {"a": 7})).outputs[0].new_token_ids == [7]
    last = s.update_from_output(so2, output(so2, {"a": 8})).outputs[0]
    assert last.new_token_ids == [8] and last.finish_reason == FinishReason.LENGTH
    assert s.update_from_output(so3, output(so3, {})).outputs == []
    assert a.all_token_ids[5:] == [7, 8] and a.num_output_placeholders == 0
    so4 = s.schedule()  # tells the runner "a" finished
    assert so4.finished_req_ids == ["a"]
    s.update_from_output(so4, output(so4, {}))
    assert not s.has_work()
    s.check_integrity()


def test_a_stop_drops_the_token_already_in_flight_and_frees_the_blocks():
    s = make()
    a = add(s, "a", 3, max_tokens=10, stop_token_ids=[9])
    b = add(s, "b", 4, max_tokens=3)
    so1 = s.schedule()
    so2 = s.schedule()  # both decode their step-1 token, in flight
    assert so2.num_scheduled_tokens == {"a": 1, "b": 1}
    outs = s.update_from_output(so1, output(so1, {"a": 9, "b": 5})).outputs
    assert [(o.request_id, o.finish_reason) for o in outs] == [
        ("a", FinishReason.STOP),
        ("b", None),
    ]
    assert a.status == RequestStatus.FINISHED_STOPPED and "a" not in s.kv.req_blocks
    so3 = s.schedule()  # "a" is gone; the runner learns it now
    assert so3.finished_req_ids == ["a"] and so3.num_scheduled_tokens == {"b": 1}
    outs = s.update_from_output(so2, output(so2, {"a": 4, "b": 6})).outputs
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("b", [6])]  # a's 4: dropped
    outs = s.update_from_output(so3, output(so3, {"b": 7})).outputs
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert b.output_token_ids == [5, 6, 7] and a.output_token_ids == [9]
    s.check_integrity()


def test_preemption_drops_the_in_flight_token_and_recomputes_it():
    # 4 blocks of 4: "a" (8 tokens) and "b" (7) fill them; b's next block preempts "b"
    s = make(num_kv_blocks=4, max_model_len=16)
    a = add(s, "a", 7, max_tokens=5)
    b = add(s, "b", 7, max_tokens=5)
    so1 = s.schedule()  # both prefill (2 blocks each), both sample
    so2 = s.schedule()  # position 7 fits both; b's placeholder
    so3 = s.schedule()  # position 8 needs a 5th block: "b" (newest) is preempted
    assert so3.preempted_req_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    assert b.num_output_placeholders == 0 and a.num_output_placeholders == 3
    s.check_integrity(idle=False)
    s.update_from_output(so1, output(so1, {"a": 1, "b": 2}))
    s.update_from_output(so2, output(so2, {"a": 3, "b": 4}))
    assert b.output_token_ids == []  # both of b's in-flight tokens dropped: it recomputes
    s.update_from_output(so3, output(so3, {"a": 5}))
    assert a.output_token_ids == [1, 3, 5]
    s.check_integrity(idle=False)


def test_never_scheduled_past_max_model_len():
    s = make(max_model_len=8)
    a = add(s, "a", 6, max_tokens=10)
    so1 = s.schedule()
    so2 = s.schedule()  # position 6 (in flight), samples the 8th token
    assert so2.num_scheduled_tokens == {"a": 1}
    so3 = s.schedule()  # 6 known + 2 in flight = max_model_len: nothing to compute
    assert so3.num_scheduled_tokens == {}
    s.update_from_output(so1, output(so1, {"a": 1}))
    out = s.update_from_output(so2, output(so2, {"a": 2})).outputs[0]
    assert out.finish_reason == FinishReason.LENGTH and a.output_token_ids == [1, 2]
    s.update_from_output(so3, output(so3, {}))
    s.check_integrity(idle=False)
