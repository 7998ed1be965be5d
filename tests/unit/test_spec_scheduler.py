"""The scheduler's half of speculative decoding (scheduler/spec/lookahead.py), without a
model: drafts as lookahead tokens, their KV slots given back, adaptive draft caps, stats."""

from __future__ import annotations

from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.messages import ModelRunnerOutput
from tandem.scheduler.request import Request
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.scheduler.spec.lookahead import PROBE_STEPS
from tandem.wire.engine_protocol import SamplingParams

K = 4


def make(prefix_caching: bool = True) -> Scheduler:
    spec = SpeculativeConfig("ngram", K, prompt_lookup_min=1, prompt_lookup_max=2)
    return Scheduler(
        SchedulerConfig(
            num_kv_blocks=32,
            block_size=4,
            max_num_batched_tokens=64,
            max_model_len=64,
            enable_prefix_caching=prefix_caching,
            speculative=spec,
        )
    )


def answer(so, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    rids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=rids, sampled_token_ids=[tokens.get(r, []) for r in rids])


def test_drafts_take_slots_and_rejected_ones_come_back():
    s = make()
    req = Request("a", [7, 1, 2, 3, 4, 5, 6, 9, 1, 2], SamplingParams(max_tokens=20))
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, answer(so, {"a": [3]}))  # ... 1 2 | 3: "2 3" was followed by 4
    so = s.schedule()
    drafts = so.scheduled_spec_decode_tokens["a"]
    assert drafts == [4, 5, 6, 9] and so.num_scheduled_tokens["a"] == 1 + K
    assert len(s.kv.req_blocks["a"]) == 4  # 15 positions
    assert s.kv.num_cached_blocks["a"] <= 11 // 4  # only known tokens are hashed
    assert req.all_token_ids[-1] == 3  # drafts are not tokens yet
    s.update_from_output(so, answer(so, {"a": [4, 8]}))  # d1 kept, d2 rejected, 8 the target's
    assert req.all_token_ids[11:] == [4, 8]
    assert req.num_computed_tokens == 12  # 3 and the kept 4
    assert len(s.kv.req_blocks["a"]) == 3  # the fourth block held only rejected drafts
    s.check_integrity(idle=False)
    stats = s.make_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, K)
    assert stats.spec_decode_num_accepted_tokens == 1
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0, 0]
    assert req.spec_k == 2  # one kept: the next cap is the kept run + 1
    s.finish_requests("a", req.status.FINISHED_ABORTED)
    s.check_integrity()


def test_draft_cap_halves_to_off_then_probes():
    s = make(prefix_caching=False)
    req = Request("a", [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=60))
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, answer(so, {"a": [1]}))
    caps = []
    for _ in range(3):  # every first draft rejected (by another seen token): cap 4 -> 2 -> 1 -> 0
        so = s.schedule()
        drafts = so.scheduled_spec_decode_tokens["a"]
        caps.append(len(drafts))
        s.update_from_output(so, answer(so, {"a": [drafts[0] % 3 + 1]}))
        s.check_integrity(idle=False)
    assert caps == [3, 2, 1] and req.spec_k == 0  # 3: the lookup had 3 tokens to give
    waited = 0
    while True:
        so = s.schedule()
        if "a" in so.scheduled_spec_decode_tokens:
            break
        waited += 1
        s.update_from_output(so, answer(so, {"a": [1]}))
    assert waited == PROBE_STEPS - 1
    (probe,) = so.scheduled_spec_decode_tokens["a"]  # one draft
    s.update_from_output(so, answer(so, {"a": [probe, 2]}))  # kept: drafting again
    assert req.spec_k == 2
    s.check_integrity(idle=False)


def test_drafts_never_pass_max_tokens():
    s = make()
    req = Request("a", [1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=3))
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, answer(so, {"a": [1]}))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens["a"] == [2]  # 1 output + 1 draft + 1 = 3
    out = s.update_from_output(so, answer(so, {"a": [2, 1]}))
    assert out.outputs[0].finish_reason is not None and req.num_output_tokens == 3
    s.check_integrity()


def test_disable_by_batch_size():
    spec = SpeculativeConfig("ngram", K, 1, 2, disable_by_batch_size=2)
    s = Scheduler(SchedulerConfig(num_kv_blocks=32, block_size=4, max_model_len=64,
                                  speculative=spec))  # fmt: skip
    prompt = [1, 2, 3, 1, 2, 3]
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=20)))
    so = s.schedule()
    s.update_from_output(so, answer(so, {"a": [1]}))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens  # one running request: drafts
    s.update_from_output(so, answer(so, {"a": [2]}))
    s.add_request(Request("b", prompt, SamplingParams(max_tokens=20)))
    so = s.schedule()  # b's prefill joins
    s.update_from_output(so, answer(so, {"a": [3], "b": [1]}))
    so = s.schedule()
    assert not so.scheduled_spec_decode_tokens  # two running: no drafts
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    s.update_from_output(so, answer(so, {"a": [1], "b": [2]}))
    s.check_integrity(idle=False)
