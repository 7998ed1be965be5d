"""The scheduler's half of speculative decoding (scheduler/spec/lookahead.py), without a
model: drafts as lookahead tokens, their KV slots given back, adaptive draft caps
(scheduler/spec/adaptive.py), stats."""

from __future__ import annotations

from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.messages import ModelRunnerOutput
from tandem.scheduler.request import Request
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.spec.adaptive import PROBE_STEPS, DraftPolicy, break_even
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.wire.engine_protocol import SamplingParams

K = 4


def make(prefix_caching: bool = True, blocks: int = 32, budget: int = 64, max_len: int = 64):
    spec = SpeculativeConfig("ngram", K, prompt_lookup_min=1, prompt_lookup_max=2)
    return Scheduler(
        SchedulerConfig(
            num_kv_blocks=blocks,
            block_size=4,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
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
    req.spec_k = K  # a request whose cap grew to K (see the adaptive tests below)
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


def test_draft_cap_starts_at_one_and_grows_only_on_acceptance():
    s = make()
    req = Request("a", [*range(1, 30), 1], SamplingParams(max_tokens=30))
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, answer(so, {"a": [2]}))  # ... 1 2: the prompt goes on 3 4 5 ..
    caps = []
    for _ in range(4):  # every draft kept
        so = s.schedule()
        drafts = so.scheduled_spec_decode_tokens["a"]
        caps.append(len(drafts))
        s.update_from_output(so, answer(so, {"a": [*drafts, drafts[-1] + 1]}))
        s.check_integrity(idle=False)
    assert caps == [1, 2, 4, 4]  # doubles up to K
    so = s.schedule()
    drafts = so.scheduled_spec_decode_tokens["a"]
    s.update_from_output(so, answer(so, {"a": [drafts[0], 99]}))  # one kept
    assert req.spec_k == 2  # the kept run + 1
    assert req.all_token_ids[-2:] == [drafts[0], 99]
    s.check_integrity(idle=False)


def test_misses_turn_drafting_off_then_probes_on_probe_steps():
    s = make(prefix_caching=False, blocks=64, max_len=256)
    req = Request("a", [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=200))
    s.add_request(req)
    drafting_steps, kept = [], False
    for _ in range(200):
        so = s.schedule()
        drafts = so.scheduled_spec_decode_tokens.get("a")
        if drafts:
            drafting_steps.append(s.spec.policy.steps)
            assert len(drafts) == 1  # cap 1 (halved down to 1), then one-draft probes
        if drafts and len(drafting_steps) == 7:  # the third probe: kept, drafting again
            s.update_from_output(so, answer(so, {"a": [drafts[0], 2]}))
            kept = True
            break
        else:  # rejected: another token than the draft
            s.update_from_output(so, answer(so, {"a": [drafts[0] % 3 + 1] if drafts else [1]}))
        s.check_integrity(idle=False)
    # the first decode step drafts (cap 1); alone, a request needs an acceptance of
    # 1/9: its own halves with each miss, and falls below after four misses: off. The
    # probes come on probe steps (every PROBE_STEPS at one request), and each missed
    # probe in a row doubles the gap to the next: skipping one probe step, then three
    probes = [PROBE_STEPS, 3 * PROBE_STEPS, 7 * PROBE_STEPS]
    assert drafting_steps == [2, 3, 4, 5, *probes] and kept
    assert req.spec_k == 1 and req.spec_misses == 0
    so = s.schedule()
    (d,) = so.scheduled_spec_decode_tokens["a"]
    s.update_from_output(so, answer(so, {"a": [d, d % 3 + 1]}))
    assert req.spec_k == 2
    s.check_integrity(idle=False)


def test_acceptance_needed_grows_with_the_batch():
    assert break_even(1) < 0.15 and break_even(8) == 0.5 and break_even(32) >= 0.8
    for batch, drafting in ((1, True), (4, True), (32, False)):
        policy = DraftPolicy(K)
        req = Request("a", [1, 2, 3], SamplingParams(max_tokens=100))
        for _ in range(12):  # about half of every step's drafts kept
            policy.begin_step(batch)
            cap = policy.cap(req)
            if cap:
                policy.update(req, cap, (cap + 1) // 2)
        assert (req.spec_k > 0) == drafting, batch


def test_low_acceptance_at_large_batch_drafts_only_on_rare_probe_steps():
    """32 running requests whose drafts are all rejected: one step of first drafts (cap
    1), then the probes of all of them share the probe steps (every 4 * PROBE_STEPS at 32
    requests), and back off: almost every step is a plain decode step."""
    s = make(prefix_caching=False, blocks=32 * 64, budget=512, max_len=256)
    for i in range(32):
        s.add_request(Request(f"r{i}", [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=240)))
    drafting_steps = []
    for _ in range(200):
        so = s.schedule()
        spec = so.scheduled_spec_decode_tokens
        if spec:
            drafting_steps.append(s.spec.policy.steps)
            assert all(len(d) == 1 for d in spec.values())
        tokens = {r: [spec[r][0] % 3 + 1] if r in spec else [1] for r in so.num_scheduled_tokens}
        s.update_from_output(so, answer(so, tokens))
    period = 4 * PROBE_STEPS
    assert s.spec.policy.probe_period(32) == period
    assert drafting_steps == [2, period, 3 * period]  # the second probe skips one
    assert s.spec.policy.rate < 0.01  # the batch's measured acceptance
    late = Request("late", [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=10))
    s.add_request(late)
    for _ in range(2):  # its prefill, its first decode step: it starts off, as the batch
        so = s.schedule()
        assert not so.scheduled_spec_decode_tokens
        s.update_from_output(so, answer(so, {r: [1] for r in so.num_scheduled_tokens}))
    assert late.spec_k == -1 and late.num_output_tokens == 2  # no drafts verified yet
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
