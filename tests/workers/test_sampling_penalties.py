"""Penalties, logit bias, bad words and min-p in the sampler, against plain
torch reference implementations written one token at a time."""

from __future__ import annotations

import math

import msgspec
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.sampling.penalties import apply_min_p, banned_last_tokens
from tandem.workers.sampling.sampler import Sampler
from tandem.workers.sampling.state import SamplingExtras


def reference_logits(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One row, token by token: bias, bad words, then vLLM's penalties."""
    out = logits.clone().tolist()
    for token_id, bias in (params.logit_bias or {}).items():
        out[token_id] += bias
    for word in params.bad_words_token_ids:
        if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]:
            if len(output) >= len(word) - 1:
                out[word[-1]] = -math.inf
    for v in range(len(out)):
        count = output.count(v)
        if v in prompt or count:
            r = params.repetition_penalty
            out[v] = out[v] / r if out[v] > 0 else out[v] * r
        out[v] -= params.frequency_penalty * count
        out[v] -= params.presence_penalty * (1.0 if count else 0.0)
    return torch.tensor(out, dtype=torch.float32)


_PENALTY = st.sampled_from([0.0, 0.0, -2.0, -0.5, 0.7, 2.0])
_REPETITION = st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0])


@st.composite
def _rows(draw):
    vocab = draw(st.integers(2, 40))
    num_rows = draw(st.integers(1, 6))
    rows = []
    for _ in range(num_rows):
        ids = st.integers(0, vocab - 1)
        bias = draw(st.none() | st.dictionaries(ids, st.floats(-100, 100), max_size=3))
        words = draw(st.lists(st.lists(ids, min_size=1, max_size=3), max_size=2))
        params = SamplingParams(
            temperature=0.0,
            presence_penalty=draw(_PENALTY),
            frequency_penalty=draw(_PENALTY),
            repetition_penalty=draw(_REPETITION),
            logit_bias=bias or None,
            bad_words_token_ids=words,
        )
        prompt = draw(st.lists(ids, min_size=1, max_size=8))
        output = draw(st.lists(ids, max_size=8))
        rows.append((params, prompt, output))
    seed = draw(st.integers(0, 2**31))
    return vocab, rows, seed


@settings(max_examples=150, deadline=None)
@given(_rows())
def test_batched_extras_equal_the_reference(case):
    vocab, rows, seed = case
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 4
    extras = SamplingExtras(vocab, torch.device("cpu"), initial_rows=1)
    ids, histories = [], []
    for i, (params, prompt, output) in enumerate(rows):
        # a third of the rows get their output one token at a time (record)
        if i % 3 == 2:
            extras.add(f"r{i}", params, prompt, len(prompt))
            for token_id in output:
                extras.record([f"r{i}"], [token_id])
        else:
            extras.add(f"r{i}", params, prompt + output, len(prompt))
        ids.append(f"r{i}")
        histories.append((prompt + output, len(prompt)))
    extras.check_integrity()
    batch = extras.batch(ids, histories)
    got = batch.apply(logits) if batch is not None else logits
    for i, (params, prompt, output) in enumerate(rows):
        want = reference_logits(logits[i], params, prompt, output)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[i][finite], want[finite], rtol=1e-5, atol=1e-4)
    # greedy picks the reference's argmax (up to rounding ties)
    tokens, _ = Sampler().sample(logits, [p for p, _, _ in rows], [0] * len(rows),
                                 [0] * len(rows), [None] * len(rows), batch)  # fmt: skip
    for i, (params, prompt, output) in enumerate(rows):
        want = reference_logits(logits[i], params, prompt, output)
        if torch.isfinite(want).any():
            assert want[tokens[i]] >= want.max() - 1e-4
    for rid in ids:
        extras.remove(rid)
    extras.check_integrity()
    assert extras.num_tracked == 0


def test_penalties_push_the_way_they_should():
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.5, 2.9]])
    prompt, output = [1], [0, 0, 2]

    def penalised(**kw):
        params = SamplingParams(**kw)
        extras = SamplingExtras(5, torch.device("cpu"))
        extras.add("a", params, prompt + output, len(prompt))
        return extras.batch(["a"], [(prompt + output, len(prompt))]).apply(logits)[0]

    base = logits[0]
    presence = penalised(presence_penalty=1.0)
    assert presence[0] == base[0] - 1 and presence[2] == base[2] - 1  # output tokens
    assert presence[1] == base[1] and presence[4] == base[4]  # prompt-only / unseen
    frequency = penalised(frequency_penalty=1.0)
    assert frequency[0] == base[0] - 2 and frequency[2] == base[2] - 1
    repetition = penalised(repetition_penalty=2.0)
    # seen tokens move away from being picked: positive halves, negative doubles
    assert repetition[0] == 1.5 and repetition[1] == 1.0 and repetition[2] == -2.0
    assert repetition[3] == base[3] and repetition[4] == base[4]
    # the most likely token changes from 0 to 4 under each penalty
    for row in (presence, frequency, repetition):
        assert int(row.argmax()) == 4
    negative = penalised(presence_penalty=-1.0)
    assert int(negative.argmax()) == 0 and negative[0] == base[0] + 1


def test_logit_bias_forces_and_forbids_tokens_in_greedy_and_seeded_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
        SamplingParams(temperature=1.0, seed=3, logit_bias={11: 100.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={int(logits[3].argmax()): -100.0}),
    ]
    extras = SamplingExtras(50, torch.device("cpu"))
    for i, p in enumerate(params):
        extras.add(f"r{i}", p, [1, 2], 2)
    batch = extras.batch([f"r{i}" for i in range(4)], [([1, 2], 2)] * 4)
    tokens, _ = Sampler().sample(logits, params, [2] * 4, [0] * 4, [None] * 4, batch)
    assert tokens[0] == 7 and tokens[1] == 11
    assert tokens[2] == int(logits[2].argmax())
    assert tokens[3] != int(logits[3].argmax())


def test_bad_words_ban_only_the_completing_token():
    assert banned_last_tokens([[5]], []) == [5]
    assert banned_last_tokens([[1, 2, 3]], [9, 1, 2]) == [3]
    assert banned_last_tokens([[1, 2, 3]], [1, 9]) == []
    assert banned_last_tokens([[1, 2]], []) == []


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 60), st.floats(0.0, 1.0), st.floats(0.2, 3.0), st.integers(0, 2**31))
def test_min_p_keeps_exactly_the_tokens_above_the_scaled_max(vocab, min_p, temp, seed):
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    scaled = logits / temp
    kept = torch.isfinite(apply_min_p(scaled, torch.tensor([min_p])))[0]
    probs = scaled.softmax(-1)[0]
    want = probs >= min_p * probs.max()
    close = (probs - min_p * probs.max()).abs() <= 1e-6  # rounding at the boundary
    assert torch.equal(kept[~close], want[~close])
    assert kept[int(probs.argmax())]
    # sampled tokens stay in the kept set
    params = SamplingParams(temperature=temp, min_p=min_p, seed=seed)
    for position in range(20):
        (token,), _ = Sampler().sample(logits, [params], [position], [0], [None])
        assert kept[token]


def test_seeded_row_ignores_its_batch_mates_features():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    plain = SamplingParams(temperature=0.9, seed=21, top_p=0.9)
    mates = [
        SamplingParams(temperature=1.0, presence_penalty=1.5, logit_bias={3: 50.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.7, bad_words_token_ids=[[4]]),
    ]
    for position in range(30):
        (alone,), _ = Sampler().sample(logits[:1], [plain], [position], [0], [None])
        extras = SamplingExtras(64, torch.device("cpu"))
        for i, p in enumerate(mates, 1):
            extras.add(f"m{i}", p, [3, 4, 5], 3)
        batch = extras.batch(["x", "m1", "m2"], [([1], 1), ([3, 4, 5], 3), ([3, 4, 5], 3)])
        together, _ = Sampler().sample(
            logits, [plain, *mates], [position] * 3, [0] * 3, [None] * 3, batch
        )
        assert together[0] == alone


def test_params_validate_names_the_field():
    bad = [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3.0),
        dict(repetition_penalty=0.0),
        dict(min_p=1.1),
        dict(logit_bias={1: 101.0}),
        dict(bad_words_token_ids=[[]]),
    ]
    for kw in bad:
        name = next(iter(kw)).split("_token_ids")[0]
        try:
            msgspec.structs.replace(SamplingParams(), **kw).validate()
        except ValueError as exc:
            assert name in str(exc)
        else:
            raise AssertionError(f"{kw} accepted")
