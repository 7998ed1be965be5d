"""Sampler: greedy, temperature, top-k/top-p, seeds, min_tokens, logprobs."""

from __future__ import annotations

import torch

from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.sampling.sampler import Sampler, mix_seed, uniform_for


def _sample(sampler, logits, params, positions=None, counts=None, eos=None):
    n = logits.shape[0]
    return sampler.sample(
        logits,
        params,
        positions if positions is not None else [0] * n,
        counts if counts is not None else [0] * n,
        eos if eos is not None else [None] * n,
    )


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_is_argmax_with_lowest_id_on_ties():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen)
    logits[5, 17] = logits[5, 200] = logits[5].max() + 1.0  # tie: lowest id wins
    params = [SamplingParams(temperature=0.0) for _ in range(64)]
    token_ids, logprobs = _sample(Sampler(), logits, params)
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert token_ids[5] == 17
    assert logprobs is None


def test_top_k_one_and_tiny_temperature_are_greedy():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 500, generator=gen)
    params = [SamplingParams(temperature=1.5, top_k=1) for _ in range(16)]
    params += [SamplingParams(temperature=1e-7) for _ in range(16)]
    token_ids, _ = _sample(Sampler(), logits, params)
    assert token_ids == logits.argmax(dim=-1).tolist()


def test_logits_not_modified():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=gen)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.8, top_k=5, top_p=0.5, min_tokens=3, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.0, top_k=3),
    ]
    _sample(Sampler(), logits, params, eos=[2, 2, 2, 2])
    assert torch.equal(logits, before)


def test_seed_and_position_fix_the_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    vocab_size = 257
    target = torch.randn(vocab_size, generator=gen)
    cases = [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, seed=-5, top_p=0.9),
        SamplingParams(temperature=1.3, seed=2**63 + 7, top_k=20),
        SamplingParams(temperature=1.0, seed=0, top_k=50, top_p=0.8),
    ]
    mates = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_p=0.3),
        SamplingParams(temperature=2.0, top_k=4, seed=99),
    ]
    for params in cases:
        for position in (0, 1, 1000, 123456):
            alone, _ = _sample(Sampler(), target.unsqueeze(0), [params], [position])
            for num_before in (0, 2, 4):
                batch_logits = torch.randn(5, vocab_size, generator=gen)
                batch_logits[num_before] = target
                batch_params = list(mates)
                batch_params.insert(num_before, params)
                positions = [7, 8, 9, 10, 11]
                positions[num_before] = position
                sampler = Sampler(seed=num_before)
                _sample(sampler, batch_logits, batch_params, positions)  # advance state
                in_batch, _ = _sample(sampler, batch_logits, batch_params, positions)
                assert in_batch[num_before] == alone[0], (params, position, num_before)


def test_different_seeds_and_positions_draw_differently():
    vocab_size = 1000
    logits = torch.zeros(400, vocab_size)  # uniform: every token equally likely
    by_seed = [SamplingParams(temperature=1.0, seed=s) for s in range(400)]
    tokens_by_seed, _ = _sample(Sampler(), logits, by_seed, [5] * 400)
    same_seed = [SamplingParams(temperature=1.0, seed=42)] * 400
    tokens_by_position, _ = _sample(Sampler(), logits, same_seed, list(range(400)))
    # 400 uniform draws over 1000 ids: ~330 distinct expected; collisions from a
    # shared stream would collapse this to 1.
    assert len(set(tokens_by_seed)) > 280
    assert len(set(tokens_by_position)) > 280
    assert len({mix_seed(s, p) for s in range(50) for p in range(50)}) == 2500


def test_temperature_matches_softmax_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature = 0.7
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    num_draws = 20000
    batch = logits.expand(num_draws, -1).contiguous()

    unseeded = [SamplingParams(temperature=temperature)] * num_draws
    tokens, _ = _sample(Sampler(seed=1234), batch, unseeded)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    # 7 degrees of freedom: the 99.9% quantile of chi-square is 24.3.
    assert _chi_square(counts, probs) < 24.3

    seeded = [SamplingParams(temperature=temperature, seed=s) for s in range(4000)]
    tokens, _ = _sample(Sampler(), batch[:4000], seeded, [3] * 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    assert _chi_square(counts, probs) < 24.3


def _allowed_set(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """Reference in float64: top-k by rank, then the smallest top-p prefix."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    kept_probs = probs[order] / probs[order].sum()
    allowed, mass = [], 0.0
    for token_id, p in zip(order, kept_probs.tolist(), strict=True):
        allowed.append(token_id)
        mass += p
        if mass >= top_p:
            break
    return set(allowed)


def test_top_k_top_p_stay_in_allowed_set_and_cover_it():
    gen = torch.Generator().manual_seed(4)
    vocab_size = 64
    # Logits on a coarse grid with distinct values: no ties, clear top-p edges.
    logits = torch.randperm(vocab_size, generator=gen).float() * 0.15
    configs = [
        (1.0, 5, 1.0),
        (1.0, 0, 0.6),
        (0.8, 10, 0.75),
        (1.5, -1, 0.9),
        (1.0, 3, 0.999),
    ]
    num_draws = 3000
    for temperature, top_k, top_p in configs:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        allowed = _allowed_set(logits, temperature, top_k, top_p)
        batch = logits.expand(num_draws, -1).contiguous()
        tokens, _ = _sample(Sampler(seed=5), batch, [params] * num_draws)
        assert set(tokens) == allowed, (temperature, top_k, top_p)
        seeded = [
            SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=s)
            for s in range(300)
        ]
        tokens, _ = _sample(Sampler(), batch[:300], seeded)
        assert set(tokens) <= allowed


def test_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]] * 50)
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 50
    tokens, _ = _sample(Sampler(seed=0), logits, params)
    assert tokens == [1] * 50


def _draw_many(logits: torch.Tensor, params: SamplingParams, num_calls: int, seed: int):
    """num_calls x 50 draws from one logits row, in batches of 50 rows."""
    sampler, batch = Sampler(seed=seed), logits.expand(50, -1).contiguous()
    tokens: list[int] = []
    for _ in range(num_calls):
        tokens += _sample(sampler, batch, [params] * 50)[0]
    return tokens


def test_inverse_cdf_keeps_mass_over_a_large_vocab():
    """Float32 cumsum over 20k tokens must not shift mass between groups."""
    vocab_size = 20_000
    logits = torch.zeros(vocab_size)
    logits[::2] = 1.0  # even ids carry e / (1 + e) of the mass
    even_mass = torch.e / (1 + torch.e)
    tokens = _draw_many(logits, SamplingParams(temperature=1.0), 20, seed=7)
    sigma = (len(tokens) * even_mass * (1 - even_mass)) ** 0.5
    assert abs(sum(t % 2 == 0 for t in tokens) - len(tokens) * even_mass) < 4 * sigma


def test_top_p_cut_beyond_the_candidates():
    """A long tail puts the top-p cut past the 256 candidates (full-sort path)."""
    vocab_size = 2000
    logits = torch.empty(vocab_size)
    logits[:10] = 6.0 + torch.arange(10) * 0.01  # 10 heavy tokens
    logits[10:] = -torch.arange(vocab_size - 10) * 2e-4  # slowly falling tail, by id
    heavy_mass = float(torch.softmax(logits.double(), -1)[:10].sum())
    assert 0.4 < heavy_mass < 0.8
    top_p = heavy_mass + 0.5 * (1 - heavy_mass)  # about half of the tail
    cut_id = max(_allowed_set(logits, 1.0, 0, top_p)) + 1  # allowed: ids < cut_id
    assert 500 < cut_id < 1500
    tokens = _draw_many(logits, SamplingParams(temperature=1.0, top_p=top_p), 20, seed=8)
    # float32 vs the float64 reference may move the cut by a token or two.
    assert cut_id - 100 < max(tokens) < cut_id + 3


def test_seeded_stream_is_pinned():
    """P and D engines of different builds must agree: the stream is frozen."""
    assert uniform_for(0, 0) == 0.6524484863740322
    assert uniform_for(1234, 56789) == 0.5234319476980501
    assert mix_seed(-1, 2**40) == 0x4043E770D2F31EFE


def test_min_tokens_masks_eos_and_stop_ids():
    vocab_size = 40
    eos_id, stop_ids = 3, [7, 9]
    logits = torch.zeros(200, vocab_size)
    logits[:, [eos_id, *stop_ids]] = 30.0  # overwhelmingly likely unless masked
    params = [
        SamplingParams(temperature=t, min_tokens=4, stop_token_ids=stop_ids, seed=s)
        for t, s in [(0.0, None), (1.0, None), (1.0, 1)] * 66 + [(0.5, 2), (0.0, 3)]
    ]
    tokens, _ = _sample(Sampler(seed=0), logits, params, counts=[3] * 200, eos=[eos_id] * 200)
    assert not {eos_id, *stop_ids} & set(tokens)

    tokens, _ = _sample(Sampler(seed=0), logits, params, counts=[4] * 200, eos=[eos_id] * 200)
    assert set(tokens) <= {eos_id, *stop_ids}
    assert tokens[0] == eos_id  # greedy: lowest id among the tied maxima

    # Out-of-range stop ids and a missing EOS are ignored, not an error.
    odd = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[vocab_size + 5])]
    tokens, _ = _sample(Sampler(), logits[:1], odd, counts=[0], eos=[None])
    assert tokens == [eos_id]


def test_logprobs_are_raw_log_softmax_sorted_with_stable_ties():
    gen = torch.Generator().manual_seed(6)
    vocab_size = 100
    logits = torch.randn(4, vocab_size, generator=gen)
    top = logits[0].max() + 2.0
    logits[0, [30, 10, 70]] = top  # three-way tie at the top
    params = [
        SamplingParams(temperature=0.5, logprobs=5, min_tokens=1, stop_token_ids=[10]),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, logprobs=0, seed=8),
        SamplingParams(temperature=0.0, top_k=1, logprobs=vocab_size + 10),
    ]
    tokens, logprobs = _sample(Sampler(seed=0), logits, params, counts=[0] * 4, eos=[None] * 4)
    assert logprobs is not None and logprobs[1] is None
    expected = torch.log_softmax(logits, dim=-1)

    lp0 = logprobs[0]
    assert lp0.token_id == tokens[0]
    assert lp0.logprob == expected[0, tokens[0]].item()
    assert lp0.top_token_ids[:3] == [10, 30, 70]  # raw logits: masked id 10 still listed
    assert len(lp0.top_token_ids) == 5
    ref = sorted(range(vocab_size), key=lambda t: (-expected[0, t].item(), t))[:5]
    assert lp0.top_token_ids == ref
    assert lp0.top_logprobs == [expected[0, t].item() for t in ref]

    lp2 = logprobs[2]
    assert lp2.token_id == tokens[2] and lp2.top_token_ids == [] and lp2.top_logprobs == []
    assert lp2.logprob == expected[2, tokens[2]].item()

    lp3 = logprobs[3]  # every id: ties anywhere, longer than topk's stable range
    ref = sorted(range(vocab_size), key=lambda t: (-expected[3, t].item(), t))
    assert lp3.top_token_ids == ref
    assert lp3.top_logprobs == [expected[3, t].item() for t in ref]
    assert lp3.token_id == ref[0]


def test_top_logprobs_ties_across_the_cut_pick_lower_ids():
    logits = torch.zeros(3, 2000)
    logits[:, 1500] = 5.0
    logits[:, [1999, 700, 3]] = 2.0  # three-way tie for places 2-4
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=6),
    ]
    _, logprobs = _sample(Sampler(), logits, params)
    assert logprobs[0].top_token_ids == [1500, 3]
    assert logprobs[1].top_token_ids == [1500, 3, 700]
    assert logprobs[2].top_token_ids == [1500, 3, 700, 1999, 0, 1]
