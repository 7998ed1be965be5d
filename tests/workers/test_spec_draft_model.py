"""Speculative decoding with a draft model (issue #26; ``workers/spec/draft_model.py``).

Two drafts over the ``tiny`` target: ``tiny`` itself (the same weights, its own KV cache:
nearly every draft is accepted, so accepted runs are long and stops land inside them)
and a random two-layer model with another seed (almost nothing accepted). Both must give
the plain engine's greedy tokens exactly; the first also shows that the draft's KV stays
valid through chunked prefill, prefix hits and preemption (acceptance stays near 1, and
the draft recomputes what it did not compute itself).
"""

from __future__ import annotations

import pytest
import torch

from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tests.workers.test_spec_decode import greedy, prompts, run


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    """A random model of another seed and shape with tiny's tokenizer."""
    from tandem.workers.checkpoints.tiny import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("draft") / "tiny-draft"
    write_tiny_checkpoint(str(path), seed=99, num_hidden_layers=2, intermediate_size=256)
    return str(path)


def draft(model: str = "tiny", k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def acceptance(engine: EngineCore) -> float:
    stats = engine.scheduler.spec.stats
    assert stats.num_draft_tokens > 0
    return stats.num_accepted_tokens / stats.num_draft_tokens


def test_self_draft_greedy_identical_with_chunks_and_prefix_hits():
    requests = [(p, greedy(), 1) for p in prompts()]
    requests += requests  # the second copy hits the prefix cache
    plain, plain_reasons, _ = run(requests, None)
    spec, reasons, engine = run(requests, draft())
    assert spec == plain and reasons == plain_reasons
    assert engine.scheduler.prefix_cache_hits > 0
    assert acceptance(engine) > 0.95  # the draft's KV was valid at every step
    stats = engine.scheduler.spec.stats
    assert all(stats.accepted_per_pos)
    drafter = engine.runner.drafter
    # the prefix hits' prompts are recomputed by the draft (its KV is per request)
    assert drafter.num_catch_up_tokens >= sum(len(p) - 1 for p, _, _ in requests)


def test_random_draft_accepts_almost_nothing_and_stays_exact(random_draft):
    requests = [(p, greedy(), 1) for p in prompts()] * 2
    plain, plain_reasons, _ = run(requests, None)
    spec, reasons, engine = run(requests, draft(random_draft))
    assert spec == plain and reasons == plain_reasons
    assert acceptance(engine) < 0.2


def test_self_draft_under_preemption():
    requests = [(p, greedy(40), 1) for p in prompts(2)] * 2
    small = dict(num_kv_blocks=24, max_model_len=160)
    plain, _, _ = run(requests, None, **small)
    spec, _, engine = run(requests, draft(), **small)
    assert spec == plain
    assert engine.scheduler.num_preemptions > 0
    assert acceptance(engine) > 0.9


@pytest.mark.parametrize("where", ["stop_token", "max_tokens", "max_model_len"])
def test_stops_inside_an_accepted_run(where):
    prompt = prompts()[0]
    base, _, _ = run([(prompt, greedy(30), 1)], None)
    out = base[0][0]
    # a budget that holds the draft's catch-up of the prompt: the first decode step drafts
    # (with budget 32 it would decode plainly while the draft caught up, one drafting step
    # fewer before the stop; tests/workers/test_spec_draft_catch_up.py covers that)
    config = {"max_num_batched_tokens": 64}
    if where == "stop_token":
        sp = greedy(30, stop_token_ids=[out[9]])
    elif where == "max_tokens":
        sp = greedy(10)
    else:
        sp, config = greedy(30), {**config, "max_model_len": len(prompt) + 11}
    plain, plain_reasons, _ = run([(prompt, sp, 1)], None, **config)
    spec, reasons, engine = run([(prompt, sp, 1)], draft(k=6), **config)
    assert spec == plain and reasons == plain_reasons
    assert len(plain[0][0]) in (10, 11)
    assert engine.scheduler.spec.stats.num_accepted_tokens >= 6


def test_parallel_sampling_and_logprobs(random_draft):
    sp = greedy(16, logprobs=2)
    requests = [(p, sp, 2) for p in prompts()[:2]]
    plain, _, plain_engine = run(requests, None)
    for model in ("tiny", random_draft):
        spec, _, engine = run(requests, draft(model))
        assert spec == plain
        for rid in plain_engine.logprobs:
            a, b = plain_engine.logprobs[rid], engine.logprobs[rid]
            assert [x.token_id for x in a] == [y.token_id for y in b]
            assert [x.logprob for x in a] == pytest.approx([y.logprob for y in b], abs=1e-4)


def test_seeded_sampling_independent_of_batch(random_draft):
    """Drafts drawn from the draft's distribution, judged with it as q: a seeded request's
    tokens do not depend on its batch mates or the step budget."""
    prompt = prompts()[1]
    sp = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    others = [(p, SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True), 1)
              for p in prompts(3)]  # fmt: skip
    for model in ("tiny", random_draft):
        alone, _, first = run([(prompt, sp, 1)], draft(model))
        crowded, _, engine = run([*others[:2], (prompt, sp, 1), *others[2:]], draft(model),
                                 max_num_batched_tokens=16)  # fmt: skip
        assert crowded[2] == alone[0]
        assert engine.scheduler.spec.stats.num_drafts > 0
        if model == "tiny":  # the self-draft's q equals p: every sampled draft is kept
            assert acceptance(first) > 0.95


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from tandem.workers.checkpoints.tiny import write_tiny_checkpoint

    other = tmp_path / "other-vocab"
    write_tiny_checkpoint(str(other), vocab_size=300, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        EngineCore(EngineConfig.from_flat(model="tiny", speculative_config=draft(str(other)),
                                num_kv_blocks=16))  # fmt: skip
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        EngineCore(EngineConfig.from_flat(model="tiny", speculative_config=draft(str(tmp_path / "nope")),
                                num_kv_blocks=16))  # fmt: skip


def test_draft_kv_shares_the_block_ids():
    """The draft's cache has the target's blocks (its own shape), so no second allocator;
    after a run every request's draft bookkeeping is gone with its copy."""
    _, _, engine = run([(prompts()[0], greedy(8), 1)], draft())
    target, mine = engine.kv_cache, engine.runner.drafter.kv_cache
    assert mine.data_ptr() != target.data_ptr()
    assert not engine.runner.requests
    assert torch.count_nonzero(mine) > 0


def test_draft_catches_up_after_steps_without_drafts():
    """A request drafts, then decodes plainly for a while (a second request makes the
    batch reach ``disable_by_batch_size``), then drafts again: the draft first recomputes
    the positions the target computed without it, and acceptance stays near 1."""
    from tandem.wire.engine_protocol import EngineRequest

    long, short = prompts()[0], prompts()[2]
    plain, _, _ = run([(long, greedy(40), 1), (short, greedy(10), 1)], None)
    engine = EngineCore(
        EngineConfig.from_flat(
            model="tiny", block_size=8, num_kv_blocks=64, max_num_batched_tokens=32,
            speculative_config={**draft(), "disable_by_batch_size": 2},
        )
    )  # fmt: skip
    tokens = {"a": [], "b": []}

    def step() -> None:
        for o in engine.step().outputs:
            assert o.error is None, o.error
            tokens[o.request_id].extend(o.new_token_ids)

    assert engine.add_request(EngineRequest("a", long, greedy(40))) is None
    while len(tokens["a"]) < 8:
        step()
    assert engine.scheduler.spec.stats.num_draft_tokens > 0
    assert engine.add_request(EngineRequest("b", short, greedy(10))) is None
    step()  # "b" was waiting when it was scheduled: "a" may still draft in this step
    drafted = engine.scheduler.spec.stats.num_draft_tokens
    while len(tokens["b"]) < 10:
        step()
    assert engine.scheduler.spec.stats.num_draft_tokens == drafted  # two running: no drafts
    catch_up = engine.runner.drafter.num_catch_up_tokens
    while engine.has_work():
        step()
    engine.check_integrity()
    assert tokens["a"] == plain[0][0] and tokens["b"] == plain[1][0]
    assert engine.runner.drafter.num_catch_up_tokens > catch_up  # the plain steps' tokens
    assert acceptance(engine) > 0.95


def test_a_migrated_stream_resumes_drafting_with_the_same_tokens():
    """A stream cut after a few tokens and resubmitted as the gateway's migration does
    (``StreamLedger.resubmission``: prompt + sent tokens) on an engine whose draft model
    never saw it: the draft recomputes the whole resubmitted context in its first fill,
    drafts again (nearly all accepted: its KV is valid) and the stream ends with the
    undisturbed run's tokens."""
    from tandem.wire.engine_protocol import EngineRequest
    from tests.workers.spec_migration import migrate_mid_stream

    prompt, sp = prompts()[0], greedy(24)
    plain, _, _ = run([(prompt, sp, 1)], None)

    def drafting_engine() -> EngineCore:
        settings = dict(model="tiny", block_size=8, num_kv_blocks=64, max_num_batched_tokens=32)
        return EngineCore(EngineConfig.from_flat(speculative_config=draft(), **settings))

    moved = migrate_mid_stream(drafting_engine, EngineRequest("migrating", prompt, sp), 7)
    assert moved.first.scheduler.spec.stats.num_drafts > 0
    second, resubmitted = moved.second, moved.resubmitted
    assert len(resubmitted.prompt_token_ids) == len(prompt) + moved.sent_before
    assert second.scheduler.spec.stats.num_drafts > 0  # it drafted after the move
    assert acceptance(second) > 0.9  # the draft's KV of the resubmitted context is valid
    # its first fill recomputed the resubmitted context (none of it was the draft's)
    assert second.runner.drafter.num_catch_up_tokens >= len(resubmitted.prompt_token_ids) - 1
    assert moved.ledger.sent_token_ids == plain[0][0]
