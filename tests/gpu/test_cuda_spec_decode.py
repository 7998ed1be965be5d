"""Speculative decoding on CUDA (issue #26): greedy fp32 tokens identical with and without
drafts. On CUDA the plain engine's decode steps replay the decode graphs (one token per
request), while a step that carries drafts replays a verification graph (several query
tokens per request, bucketed by tokens: workers/graphs/verify.py): the two must agree token for token,
through chunked prefill, prefix hits, preemption and stops inside an accepted run, with the
n-gram proposer driven by an oracle (long accepted runs, rejections at every position) and
with the target drafting for itself (its own KV cache on the device)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.test_spec_decode import NGRAM, expected_by_prompt, greedy, prompts, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = dict(device="cuda", dtype="float32")
DRAFT = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_oracle_identical_on_cuda(async_scheduling):
    requests = [(p, greedy(), 1) for p in prompts()]
    requests += requests  # the second copy hits the prefix cache
    plain, plain_reasons, _ = run(requests, None, **CUDA)
    spec, reasons, engine = run(
        requests,
        NGRAM,
        expected_by_prompt(requests, plain),
        async_scheduling=async_scheduling,
        **CUDA,
    )
    assert spec == plain and reasons == plain_reasons
    stats = engine.scheduler.spec.stats
    assert stats.num_accepted_tokens > stats.num_draft_tokens // 2
    assert all(stats.accepted_per_pos)
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.scheduler.prefix_cache_hits > 0
    _assert_verified_in_graphs(engine)


def _assert_verified_in_graphs(engine):
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.verify is not None
    assert sum(graphs.verify.num_replays.values()) > 0, graphs.verify.num_replays


def test_ngram_oracle_identical_under_preemption_on_cuda():
    requests = [(p, greedy(40), 1) for p in prompts(2)] * 2
    small = dict(num_kv_blocks=20, max_model_len=160, **CUDA)
    plain, _, plain_engine = run(requests, None, **small)
    spec, _, engine = run(requests, NGRAM, expected_by_prompt(requests, plain), **small)
    assert spec == plain
    assert engine.scheduler.num_preemptions > 0 and plain_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("where", ["stop_token", "max_tokens"])
def test_stops_inside_an_accepted_run_on_cuda(where):
    prompt = prompts()[0]
    base, _, _ = run([(prompt, greedy(30), 1)], None, **CUDA)
    out = base[0][0]
    sp = greedy(30, stop_token_ids=[out[9]]) if where == "stop_token" else greedy(10)
    plain, plain_reasons, _ = run([(prompt, sp, 1)], None, **CUDA)
    # the oracle drafts the unconstrained continuation: past the stop point
    spec, reasons, engine = run([(prompt, sp, 1)], NGRAM, {tuple(prompt): out}, **CUDA)
    assert spec == plain and reasons == plain_reasons
    assert engine.scheduler.spec.stats.num_accepted_tokens > 0
    assert len(plain[0][0]) in (10, 11)


def test_self_draft_identical_on_cuda():
    requests = [(p, greedy(), 1) for p in prompts()]
    requests += requests
    plain, plain_reasons, _ = run(requests, None, **CUDA)
    spec, reasons, engine = run(requests, DRAFT, **CUDA)
    assert spec == plain and reasons == plain_reasons
    stats = engine.scheduler.spec.stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95
    assert engine.runner.drafter.device.type == "cuda"
    _assert_verified_in_graphs(engine)
