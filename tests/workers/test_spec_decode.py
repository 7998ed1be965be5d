"""Speculative decoding (issue #26): greedy output token-identical with and without
drafts, stops and limits inside an accepted run, rejected drafts' KV slots given back.

The random-weight ``tiny`` model accepts almost no n-gram draft, so most scenarios also
run with an oracle proposer that drafts the plain engine's own continuation with every
seventh draft corrupted: long accepted runs, rejections at every draft position, and a
stop, ``max_tokens`` or ``max_model_len`` landing inside a run.
"""

from __future__ import annotations

import pytest
import torch

from tandem.scheduler.request import Request
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.scheduler.spec.proposer import NgramProposer
from tandem.wire.engine_protocol import EngineRequest, SamplingParams, StructuredOutputsParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
VOCAB = 250  # tiny's vocabulary is 262


class OracleProposer:
    """Drafts the continuation a plain run produced (keyed by prompt), corrupting the
    draft of every output position ``p`` with ``p % 7 == 5``."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]]) -> None:
        self.expected = expected

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        for prompt, output in self.expected.items():
            n = len(prompt)
            if tuple(token_ids[:n]) == prompt and token_ids[n:] == output[: len(token_ids) - n]:
                done = len(token_ids) - n
                drafts = list(output[done : done + max_drafts])
                return [t if (done + j) % 7 != 5 else (t + 1) % VOCAB
                        for j, t in enumerate(drafts)]  # fmt: skip
        return []


def prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, VOCAB, (37,), generator=g).tolist()
    return [
        base + base[:21],  # repeats itself: n-gram hits
        base[:5] * 9,
        torch.randint(3, VOCAB, (70,), generator=g).tolist(),  # chunked at budget 32
        torch.randint(3, VOCAB, (1,), generator=g).tolist(),
    ]


def run(
    requests: list[tuple[list[int], SamplingParams, int]],
    spec: dict | None,
    oracle: dict | None = None,
    **config,
) -> tuple[list[list[list[int]]], list[list[str]], EngineCore]:
    """Every request to completion: per request, per choice, its tokens."""
    settings = dict(model="tiny", block_size=8, num_kv_blocks=64, max_num_batched_tokens=32)
    settings.update(config)
    engine = EngineCore(EngineConfig.from_flat(speculative_config=spec, **settings))
    if oracle is not None:
        engine.scheduler.spec.proposer = OracleProposer(oracle)
    tokens: dict[str, dict[int, list[int]]] = {}
    finish: dict[str, dict[int, str]] = {}
    logprobs: dict[str, list] = {}
    for i, (prompt, sp, n) in enumerate(requests):
        err = engine.add_request(EngineRequest(f"r{i}", prompt, sp, n=n))
        assert err is None, err.error
        tokens[f"r{i}"] = {k: [] for k in range(n)}
        finish[f"r{i}"] = {}
        for k in range(n):
            logprobs[(f"r{i}", k)] = []
    while engine.has_work():
        for o in engine.step().outputs:
            assert o.error is None, o.error
            tokens[o.request_id][o.index].extend(o.new_token_ids)
            if o.new_logprobs:
                logprobs[(o.request_id, o.index)].extend(o.new_logprobs)
            if o.finish_reason is not None:
                finish[o.request_id][o.index] = str(o.finish_reason)
    engine.check_integrity()
    out = [[tokens[f"r{i}"][k] for k in range(n)] for i, (_, _, n) in enumerate(requests)]
    reasons = [[finish[f"r{i}"][k] for k in range(n)] for i, (_, _, n) in enumerate(requests)]
    engine.logprobs = logprobs
    return out, reasons, engine


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def expected_by_prompt(requests, outputs) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): out[0] for (p, _, _), out in zip(requests, outputs)}


@pytest.mark.parametrize("use_oracle", [False, True])
def test_greedy_identical_with_chunks_and_prefix_hits(use_oracle):
    requests = [(p, greedy(), 1) for p in prompts()]
    requests += requests  # the second copy hits the prefix cache
    plain, plain_reasons, _ = run(requests, None)
    oracle = expected_by_prompt(requests, plain) if use_oracle else None
    spec, reasons, engine = run(requests, NGRAM, oracle)
    assert spec == plain and reasons == plain_reasons
    stats = engine.scheduler.spec.stats
    assert stats.num_drafts > 0
    if use_oracle:  # every draft position both accepted and rejected somewhere
        assert stats.num_accepted_tokens > stats.num_draft_tokens // 2
        assert all(stats.accepted_per_pos)
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.scheduler.prefix_cache_hits > 0


def test_greedy_identical_under_preemption():
    requests = [(p, greedy(40), 1) for p in prompts(2)] * 2
    small = dict(num_kv_blocks=20, max_model_len=160)
    plain, _, plain_engine = run(requests, None, **small)
    spec, _, engine = run(requests, NGRAM, expected_by_prompt(requests, plain), **small)
    assert spec == plain
    assert engine.scheduler.num_preemptions > 0 and plain_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("where", ["stop_token", "max_tokens", "max_model_len", "min_tokens"])
def test_stops_inside_an_accepted_run(where):
    prompt = prompts()[0]
    base, _, _ = run([(prompt, greedy(30), 1)], None)
    out = base[0][0]
    config = {}
    if where == "stop_token":
        sp = greedy(30, stop_token_ids=[out[9]])  # the oracle's run covers position 9
    elif where == "max_tokens":
        sp = greedy(10)
    elif where == "max_model_len":
        sp, config = greedy(30), {"max_model_len": len(prompt) + 11}
    else:  # the stop token is masked for the first 12 outputs, per verified position
        sp = greedy(30, stop_token_ids=[out[4]], min_tokens=12)
    plain, plain_reasons, _ = run([(prompt, sp, 1)], None, **config)
    # the oracle drafts the unconstrained continuation: past the stop point
    spec, reasons, engine = run(
        [(prompt, sp, 1)],
        NGRAM,
        {tuple(prompt): out if where != "min_tokens" else plain[0][0]},
        **config,
    )
    assert spec == plain and reasons == plain_reasons
    assert engine.scheduler.spec.stats.num_accepted_tokens > 0
    if where == "min_tokens":
        assert len(plain[0][0]) > 12
    else:
        assert len(plain[0][0]) in (10, 11)


def test_parallel_sampling_and_logprobs():
    sp = greedy(16, logprobs=3)
    requests = [(p, sp, 2) for p in prompts()[:2]]
    plain, _, plain_engine = run(requests, None)
    spec, _, engine = run(requests, NGRAM, {tuple(p): out[0] for (p, _, _), out in
                                            zip(requests, plain)})  # fmt: skip
    assert spec == plain
    assert engine.scheduler.spec.stats.num_accepted_tokens > 0
    for rid in plain_engine.logprobs:
        a, b = plain_engine.logprobs[rid], engine.logprobs[rid]
        assert len(a) == len(b) == 16
        for x, y in zip(a, b):
            assert (x.token_id, x.top_token_ids, x.rank) == (y.token_id, y.top_token_ids, y.rank)
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-4)


def test_seeded_sampling_independent_of_batch():
    prompt = prompts()[1]
    sp = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    alone, _, _ = run([(prompt, sp, 1)], NGRAM)
    others = [(p, SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True), 1)
              for p in prompts(3)]  # fmt: skip
    crowded, _, engine = run([*others[:2], (prompt, sp, 1), *others[2:]], NGRAM,
                             max_num_batched_tokens=16)  # fmt: skip
    assert crowded[2] == alone[0]
    assert engine.scheduler.spec.stats.num_drafts > 0


def test_penalties_do_not_speculate():
    prompt = prompts()[1]
    sp = greedy(16, repetition_penalty=1.3)
    plain, _, _ = run([(prompt, sp, 1)], None)
    spec, _, engine = run([(prompt, sp, 1)], NGRAM)
    assert spec == plain
    assert engine.scheduler.spec.stats.num_drafts == 0


def test_constrained_requests_speculate_with_the_plain_tokens():
    """The oracle drafts the unconstrained continuation, every seventh draft corrupted, for
    a free and a constrained request. Before constrained requests had per-position grammar
    rows, drafting them broke the grammar; now their drafts are cut where the grammar
    refuses one and verified against their own rows: the plain engine's tokens, and the
    constrained request's drafts accepted (more drafts and acceptances than the free
    request gets alone)."""
    free, constrained = prompts()[0], prompts()[1]
    so = greedy(12, min_tokens=8, structured_outputs=StructuredOutputsParams("regex", "[ab]+"))
    requests = [(free, greedy(12), 1), (constrained, so, 1)]
    plain, _, _ = run(requests, None)
    oracle = expected_by_prompt(requests, plain)
    spec, _, engine = run(requests, NGRAM, oracle=oracle)
    assert spec == plain
    _, _, free_alone = run(requests[:1], NGRAM, oracle=oracle)
    stats, alone = engine.scheduler.spec.stats, free_alone.scheduler.spec.stats
    assert stats.num_drafts > alone.num_drafts
    assert stats.num_accepted_tokens > alone.num_accepted_tokens


def test_ngram_proposer():
    cfg = SpeculativeConfig.from_dict(NGRAM)
    p = NgramProposer(cfg)
    assert p.propose([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]  # "2 3" seen before
    assert p.propose([1, 2, 3, 1, 2, 3, 1, 2], 8) == [3, 1, 2]  # most recent occurrence
    assert p.propose([5, 6, 7], 4) == []
    assert p.propose([1, 1], 0) == []
    long = NgramProposer(SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 2}))
    assert long.propose([7, 1, 8, 2, 1], 2) == []  # only a 1-gram matches


@pytest.mark.parametrize(("lo", "hi"), [(1, 3), (2, 4), (3, 3)])
def test_indexed_lookup_equals_the_scan(lo, hi):
    """``propose_for`` (a per-request index extended as tokens are appended, one or a few
    at a time as accepted runs append them) drafts what scanning the tokens drafts."""
    p = NgramProposer(SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": lo,
                                                   "prompt_lookup_max": hi}))  # fmt: skip
    g = torch.Generator().manual_seed(lo * 10 + hi)
    for vocab in (3, 8, 40):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),),
                               generator=g).tolist()  # fmt: skip
        req = Request("r", prompt, greedy(200))
        while req.num_tokens < 160:
            k = int(torch.randint(0, 6, (1,), generator=g))
            assert p.propose_for(req, k) == p.propose(list(req.all_token_ids), k)
            for t in torch.randint(0, vocab, (int(torch.randint(1, 5, (1,), generator=g)),),
                                   generator=g).tolist():  # fmt: skip
                req.append_output_token(t)
        assert req.ngram_index.num_indexed < req.num_tokens - 1  # indexed on lookups only
        p.propose_for(req, 0)
        assert req.ngram_index.num_indexed == req.num_tokens - 1


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "medusa2", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {
                "method": "draft_model",
                "model": "tiny",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 2,
            },
            "speculative_config.prompt_lookup_min",
        ),
        ({**NGRAM, "model": "tiny"}, "speculative_config.model"),
        ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({**NGRAM, "lookahead": 3}, "speculative_config.lookahead"),
        ({**NGRAM, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        ("{not json", "speculative_config"),
    ],
)
def test_config_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineConfig.from_flat(speculative_config=value)


def test_config_defaults_and_tp():
    cfg = EngineConfig.from_flat(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'
    )
    assert cfg.scheduler.speculative_config == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5,
        "prompt_lookup_max": 5,
    }  # fmt: skip
    assert EngineConfig.from_flat(speculative_config={}).scheduler.speculative_config is None
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_flat(speculative_config=NGRAM, tensor_parallel_size=2)


def test_async_scheduling_runs_the_synchronous_loop():
    requests = [(p, greedy(12), 1) for p in prompts()[:2]]
    plain, _, _ = run(requests, None, async_scheduling=True)
    spec, _, engine = run(requests, NGRAM, async_scheduling=True)
    assert engine.overlap is None  # speculation: the synchronous loop, said in the log
    assert spec == plain


def test_a_migrated_stream_resumes_speculation_with_the_same_tokens():
    """A stream cut after a few tokens and resubmitted as the gateway's migration does
    (``StreamLedger.resubmission``: prompt + sent tokens) drafts again on the new engine
    (its proposer reads the request's tokens, nothing engine-local) and ends with the
    tokens of the undisturbed run, which greedy makes the plain engine's."""
    from tests.workers.spec_migration import migrate_mid_stream

    prompt, sp = prompts()[0], greedy(24)
    plain, _, _ = run([(prompt, sp, 1)], None)
    oracle = expected_by_prompt([(prompt, sp, 1)], plain)

    def speculating_engine() -> EngineCore:
        engine = EngineCore(
            EngineConfig.from_flat(
                model="tiny",
                speculative_config=NGRAM,
                block_size=8,
                num_kv_blocks=64,
                max_num_batched_tokens=32,
            )
        )
        engine.scheduler.spec.proposer = OracleProposer(oracle)
        return engine

    moved = migrate_mid_stream(speculating_engine, EngineRequest("migrating", prompt, sp), 7)
    assert moved.first.scheduler.spec.stats.num_drafts > 0
    assert moved.second.scheduler.spec.stats.num_drafts > 0  # it speculated after the move
    assert moved.ledger.sent_token_ids == plain[0][0]
