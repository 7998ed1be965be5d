"""A draft model's catch-up spread over steps within the token budget (issue #26;
``scheduler/drafting.py``, ``workers/spec/draft_model.py``).

A request whose runner copy is new (a prefix hit here, a P/D handoff in
``tests/e2e/test_pd_spec_decode.py``) has no draft KV: the draft recomputes its positions.
Each step must keep target tokens + the draft's recomputed positions within
``max_num_batched_tokens`` (counted from what the runner's draft actually computed), the
scheduler's count of each request's draft KV must equal the runner's after every step, and
the tokens must be the plain engine's (greedy) or the unchunked catch-up's (seeded).
"""

from __future__ import annotations

import pytest
import torch

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tests.workers.test_spec_decode import VOCAB, greedy

BUDGET = 32


def draft(model: str = "tiny", k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    from tandem.workers.checkpoints.tiny import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("catch-up-draft") / "tiny-draft"
    write_tiny_checkpoint(str(path), seed=7, num_hidden_layers=2, intermediate_size=256)
    return str(path)


def long_prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (60 + 7 * i,), generator=g).tolist() for i in range(n)]


class Steps:
    """Every step of an engine: what the scheduler gave each request and what the runner's
    draft computed again; checks the step's budget and both sides' draft bookkeeping."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.budget = engine.sched_config.max_num_batched_tokens
        self.records: list[tuple[dict[str, int], dict[str, int], int]] = []
        inner = engine.scheduler.schedule

        def schedule():
            self.last = inner()
            return self.last

        engine.scheduler.schedule = schedule

    def step(self):
        drafter = self.engine.runner.drafter
        before = drafter.num_catch_up_tokens if drafter is not None else 0
        outs = self.engine.step()
        so = self.last
        done = (drafter.num_catch_up_tokens if drafter is not None else 0) - before
        target = sum(so.num_scheduled_tokens.values())
        assert done == sum(so.draft_catch_up.values()), (done, so.draft_catch_up)
        assert target + done <= self.budget, (target, done)
        assert so.total_num_scheduled_tokens == target + done
        self.records.append((dict(so.num_scheduled_tokens), dict(so.draft_catch_up), done))
        self.engine.scheduler.check_integrity(idle=False)
        if drafter is not None:
            drafter.check(self.engine.runner.requests, self.engine.scheduler.running)
        return outs

    def catch_up_steps(self, rid: str) -> int:
        """Steps in which ``rid``'s draft caught up by more than a drafting step's one
        position (the draft's last draft, when all were kept)."""
        return sum(1 for _, catch_up, _ in self.records if catch_up.get(rid, 0) > 1)


def run(
    waves: list[list[tuple[list[int], SamplingParams]]], spec: dict | None, **config
) -> tuple[dict[str, list[int]], EngineCore, Steps]:
    """Each wave's requests together, the next wave once the engine is idle; tokens by id."""
    settings = dict(model="tiny", block_size=8, num_kv_blocks=200, max_model_len=256,
                    max_num_batched_tokens=BUDGET, max_num_seqs=16)  # fmt: skip
    settings.update(config)
    engine = EngineCore(EngineConfig.from_flat(speculative_config=spec, **settings))
    steps = Steps(engine)
    tokens: dict[str, list[int]] = {}
    for w, wave in enumerate(waves):
        for i, (prompt, sp) in enumerate(wave):
            rid = f"w{w}-{i}"
            tokens[rid] = []
            assert engine.add_request(EngineRequest(rid, prompt, sp)) is None
        while engine.has_work():
            for o in steps.step().outputs:
                assert o.error is None, o.error
                tokens[o.request_id].extend(o.new_token_ids)
    engine.check_integrity()
    return tokens, engine, steps


def test_eight_catch_ups_arriving_together_are_split_within_the_budget():
    """The P/D shape: eight prompts whose target KV is there (prefix hits of a first
    wave) and whose draft KV is not. Their catch-up (about 680 positions) is spread over
    many steps of at most BUDGET tokens; meanwhile they decode without drafts, then draft
    with nearly every draft kept (the recomputed KV is valid); greedy tokens equal the
    plain engine's."""
    prompts = long_prompts(8)
    waves = [[(p, greedy(1)) for p in prompts], [(p, greedy(48)) for p in prompts]]
    plain, _, _ = run(waves, None)
    spec, engine, steps = run(waves, draft())
    assert spec == plain
    assert engine.scheduler.prefix_cache_hits > 0
    stats = engine.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0.95 * stats.num_draft_tokens > 0
    # every prompt of the second wave was recomputed by the draft, in several steps each
    recomputed = engine.runner.drafter.num_catch_up_tokens
    assert recomputed >= sum(len(p) - 8 for p in prompts)
    for i in range(len(prompts)):
        assert steps.catch_up_steps(f"w1-{i}") >= 2
    assert max(done for _, _, done in steps.records) <= BUDGET
    # a request went on decoding (one token, no drafts) while its draft caught up
    assert any(
        scheduled.get(rid) == 1 and catch_up.get(rid)
        for scheduled, catch_up, _ in steps.records
        for rid in scheduled
    )


def test_unchunked_when_the_budget_allows():
    """With a budget larger than the catch-up, a request's catch-up is one step's (its
    first draft forward's), as before the catch-up was chunked."""
    prompts = long_prompts(2)
    waves = [[(p, greedy(1)) for p in prompts], [(p, greedy(12)) for p in prompts]]
    _, _, steps = run(waves, draft(), max_num_batched_tokens=512)
    assert steps.catch_up_steps("w1-0") == 1 and steps.catch_up_steps("w1-1") == 1


@pytest.mark.parametrize("which", ["self", "random"])
def test_greedy_identical_with_chunked_prefill_preemption_and_prefix_hits(which, random_draft):
    prompts = long_prompts(4, seed=5)
    mixed = [(p, greedy(30)) for p in prompts] + [([5, 6, 7] * 4, greedy(30))]
    waves = [mixed, mixed]  # the second wave hits the prefix cache
    small = dict(num_kv_blocks=48, max_model_len=200)
    plain, _, _ = run(waves, None, **small)
    spec, engine, _ = run(waves, draft("tiny" if which == "self" else random_draft), **small)
    assert spec == plain
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("which", ["self", "random"])
def test_seeded_tokens_do_not_depend_on_the_catch_up_chunks(which, random_draft):
    """A seeded sampled request's tokens depend on which positions were drafted; it waits
    (emits nothing) while its draft catches up, so its tokens are the same with a budget
    that splits the catch-up among busy batch mates as alone with an unchunked one."""
    model = "tiny" if which == "self" else random_draft
    prompt = long_prompts(1, seed=9)[0]
    sp = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    alone, _, alone_steps = run([[(prompt, greedy(1))], [(prompt, sp)]], draft(model),
                                max_num_batched_tokens=512)  # fmt: skip
    if which == "self":  # drafts kept: never behind again after its one catch-up
        assert alone_steps.catch_up_steps("w1-0") == 1
    others = [(p, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
              for p in long_prompts(3, seed=10)]  # fmt: skip
    crowded, engine, steps = run(
        [[(prompt, greedy(1))], [*others[:2], (prompt, sp), *others[2:]]], draft(model),
        max_num_batched_tokens=16,
    )  # fmt: skip
    assert crowded["w1-2"] == alone["w1-0"]
    assert steps.catch_up_steps("w1-2") >= 2
    # it waited: steps with its draft catching up and no token of its own
    assert any("w1-2" in c and "w1-2" not in s for s, c, _ in steps.records)
    assert engine.scheduler.spec.stats.num_drafts > 0


def test_check_integrity_compares_the_scheduler_count_with_the_runner_one():
    """The scheduler budgets the catch-up with its own count of each request's draft KV;
    a count that drifted from the runner's is an integrity error naming the request."""
    engine = EngineCore(EngineConfig.from_flat(model="tiny", block_size=8, num_kv_blocks=64,
                                     max_num_batched_tokens=BUDGET,
                                     speculative_config=draft()))  # fmt: skip
    prompt = long_prompts(1)[0]
    assert engine.add_request(EngineRequest("r", prompt, greedy(30))) is None
    drafter = engine.runner.drafter
    while drafter.num_catch_up_tokens < BUDGET:  # its draft is catching up
        engine.step()
    (req,) = engine.scheduler.running
    drafter.check(engine.runner.requests, engine.scheduler.running)
    req.draft_computed -= 1
    with pytest.raises(AssertionError, match="r: the runner holds draft KV"):
        drafter.check(engine.runner.requests, engine.scheduler.running)
    req.draft_computed += 1
    while engine.has_work():
        engine.step()
    engine.check_integrity()
