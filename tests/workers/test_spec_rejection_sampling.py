"""Rejection sampling keeps the target distribution (``workers/sampling/spec_verify.py``).

A small vocabulary (8 tokens), fixed target logits for two positions and fixed drafts;
many independent requests (stream keys) in one batch. The first output token, and the
second given the first equals the first draft, must follow the target distribution
(temperature, top-k applied): Pearson's chi-square against a 0.1% critical value.
"""

from __future__ import annotations

import pytest
import torch

from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.sampling.spec_verify import SpecRequest, target_probs, verify

VOCAB = 8
# chi-square critical values at p = 0.001 by degrees of freedom
CRITICAL = {3: 16.27, 7: 24.32}


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    total = sum(counts)
    stat, dof = 0.0, -1
    for c, p in zip(counts, probs):
        if p > 0:
            expected = total * p
            stat += (c - expected) ** 2 / expected
            dof += 1
        else:
            assert c == 0, "a token outside the target's support was drawn"
    return stat, dof


@pytest.mark.parametrize(
    ("params", "drafts"),
    [
        (SamplingParams(temperature=1.0), [2, 5]),  # likely, then unlikely drafts
        (SamplingParams(temperature=0.7, top_k=4), [6, 0]),  # first draft outside top-k
        (SamplingParams(temperature=1.3, top_p=0.9, seed=11), [0, 0]),
    ],
)
def test_accepted_tokens_follow_the_target(params, drafts):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g) * 1.5  # rows 0, 1 and the bonus row
    num = 6000
    requests = []
    for i in range(num):
        p = (
            params
            if params.seed is None
            else SamplingParams(
                temperature=params.temperature, top_p=params.top_p, seed=params.seed + i
            )
        )
        requests.append(SpecRequest(list(drafts), p, position=10, num_output=3, stream_key=i))
    result = verify(logits.repeat(num, 1), requests, eos_token_id=None)
    probs = target_probs(logits, [params] * 3)
    first = [0] * VOCAB
    second = [0] * VOCAB
    for tokens in result.token_ids:
        assert 1 <= len(tokens) <= 3
        assert tokens[:-1] == drafts[: len(tokens) - 1]  # accepted drafts, then one token
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
    stat, dof = chi_square(first, probs[0].tolist())
    assert stat < CRITICAL.get(dof, 30.0), (stat, dof, first)
    if sum(second) > 500:
        stat, dof = chi_square(second, probs[1].tolist())
        assert stat < CRITICAL.get(dof, 30.0), (stat, dof, second)


def test_seeded_draws_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, VOCAB, generator=g)
    sp = SamplingParams(temperature=1.0, seed=123)
    mine = SpecRequest([1, 2, 3, 4], sp, position=40, num_output=2, stream_key=0)
    alone = verify(logits, [mine], None).token_ids[0]
    other = SpecRequest([0], SamplingParams(temperature=1.0), 7, 1, stream_key=99)
    rows = torch.cat((torch.randn(2, VOCAB, generator=g), logits))
    assert verify(rows, [other, mine], None).token_ids[1] == alone


def test_greedy_takes_the_longest_matching_prefix():
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([3, 1, 6, 2]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    result = verify(logits, [SpecRequest([3, 1, 7], greedy, 5, 1, 0)], None)
    assert result.token_ids == [[3, 1, 6]]
    all_match = verify(logits, [SpecRequest([3, 1, 6], greedy, 5, 1, 0)], None)
    assert all_match.token_ids == [[3, 1, 6, 2]]
    # min_tokens masks EOS per verified position: counted with the drafts before it
    masked = SamplingParams(temperature=0.0, min_tokens=3)
    eos_first = verify(logits, [SpecRequest([3, 1, 6], masked, 5, 1, 0)], eos_token_id=1)
    assert eos_first.token_ids == [[3, 0]]  # row 1's argmax (EOS) masked: lowest tied id


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, seed=3)],
)
def test_drafts_drawn_from_q_keep_the_target_distribution(params):
    """A draft model's drafts (``SpecRequest.draft_probs``): each drawn from its own q,
    kept with probability min(1, p/q), else the token is drawn from max(p - q, 0). The
    first token follows p0, and the second (after a kept first draft) p1."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=g) * 1.5
    # q: another distribution, with a token p gives mass to left out (q = 0 there)
    q = torch.softmax(torch.randn(2, VOCAB, generator=g), dim=-1)
    q[:, 1] = 0.0
    q /= q.sum(dim=-1, keepdim=True)
    num = 6000
    drafts = torch.multinomial(q, num, replacement=True, generator=g).T.tolist()  # [num, 2]
    requests = []
    for i in range(num):
        p = params if params.seed is None else SamplingParams(
            temperature=params.temperature, top_k=params.top_k, seed=params.seed + i
        )  # fmt: skip
        requests.append(SpecRequest(drafts[i], p, 10, 3, stream_key=i, draft_probs=q))
    result = verify(logits.repeat(num, 1), requests, eos_token_id=None)
    probs = target_probs(logits, [params] * 3)
    first, second = [0] * VOCAB, [0] * VOCAB
    for tokens, d in zip(result.token_ids, drafts):
        assert tokens[:-1] == d[: len(tokens) - 1]
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            second[tokens[1]] += 1
    stat, dof = chi_square(first, probs[0].tolist())
    assert stat < CRITICAL.get(dof, 30.0), (stat, dof, first)
    # q is really used: the first draft is kept with probability sum(min(p, q)) (a
    # point-mass test, also exact, would keep it with sum(p * q) only)
    kept = sum(len(tokens) >= 2 for tokens in result.token_ids) / num
    expected = float(torch.minimum(probs[0], q[0]).sum())
    assert abs(kept - expected) < 4 * (expected * (1 - expected) / num) ** 0.5, (kept, expected)
    assert abs(kept - float((probs[0] * q[0]).sum())) > 0.05
    assert sum(second) > 500
    stat, dof = chi_square(second, probs[1].tolist())
    assert stat < CRITICAL.get(dof, 30.0), (stat, dof, second)
