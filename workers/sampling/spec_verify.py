"""Verification of drafted tokens (speculative decoding): which drafts a step keeps.

A request with K drafts has K+1 logits rows in the step, one per position:

    row j (0..K)   the target's distribution of the token after  t, d1 .. dj
    drafts         d1 .. dK  (d_{j+1} is judged by row j)

Row j is processed exactly as the plain sampler processes a request's row at that
position (``workers/sampling/sampler.py``): a constrained request's grammar mask first
(its row j: what the grammar allows after d1 .. dj), then the min_tokens mask, which counts
the j drafts before it as output (and skips constrained rows, whose mask already holds
stop tokens back), then temperature, min-p, top-k, top-p. The request's output is the
accepted drafts plus one token of the target's:

- greedy rows: the longest run of drafts equal to the row's argmax, then the argmax of
  the first row that disagrees (or of row K): the plain engine's tokens exactly;
- random rows: rejection sampling. A draft drawn from a distribution q (a draft model,
  ``SpecRequest.draft_probs``) is kept with probability min(1, p(d)/q(d)); on rejection
  the token is drawn from max(p - q, 0), renormalised. A draft without a distribution
  (prompt lookup) is a point mass, q(d) = 1: kept with probability p(d), on rejection
  drawn from p with d removed. After K kept drafts row K is drawn from p. Each token is
  therefore distributed exactly as p, position by position.

The random numbers are pure functions of (the request's seed or stream key, position),
as in the plain sampler: a seeded request's tokens do not depend on its batch mates, on
chunking, or on how many drafts it got. The draw at a position uses the plain sampler's
uniform for that position; the keep/reject test uses a second stream of the same key.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.kernels.metadata import list_to_device
from tandem.wire.engine_protocol import Logprobs, SamplingParams
from tandem.workers.sampling.grammar_mask import GrammarRows, apply_grammar_mask
from tandem.workers.sampling.sampler import (
    _MIN_TEMPERATURE,
    _mask_min_tokens,
    argmax_rows,
    compute_logprobs,
    mix_seed,
    sampling_probs,
    uniform_for,
)

# keys the keep/reject uniforms, apart from the draws' (any odd 64-bit constant)
_ACCEPT_STREAM = 0xD1B54A32D192ED03


@dataclasses.dataclass(slots=True)
class SpecRequest:
    """One request's drafts in a step, as the runner planned them."""

    drafts: list[int]
    params: SamplingParams
    position: int  # index of the token row 0 samples (tokens before it)
    num_output: int  # output tokens the request has before this step
    stream_key: int  # its unseeded draws' key (Sampler.stream_key)
    # [K, V]: the distribution each draft was drawn from (a draft model's sampled
    # requests); None: the drafts are point masses (prompt lookup, greedy drafts)
    draft_probs: torch.Tensor | None = None


@dataclasses.dataclass(slots=True)
class SpecResult:
    """Per request (plan order): its output tokens this step, and their logprobs when
    it asked for them."""

    token_ids: list[list[int]]
    logprobs: list[list[Logprobs]] | None


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < _MIN_TEMPERATURE or p.top_k == 1


def verify(
    logits: torch.Tensor,
    requests: list[SpecRequest],
    eos_token_id: int | None,
    grammar: GrammarRows | None = None,
) -> SpecResult:
    """``logits``: ``[sum(K_i + 1), V]`` raw rows, the requests' rows in order.
    ``grammar``: the constrained requests' mask rows, one per verified position
    (``GrammarRows.for_verified``)."""
    params, counts = [], []
    for r in requests:
        for j in range(len(r.drafts) + 1):
            params.append(r.params)
            counts.append(r.num_output + j)
    if len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for {len(params)} verified positions")
    raw = logits.float()
    masked = raw
    if grammar is not None:  # as Sampler.sample_on_device: the mask first
        masked = apply_grammar_mask(raw, grammar)
        for row in grammar.rows:
            counts[row] = max(counts[row], params[row].min_tokens)
    masked = _mask_min_tokens(masked, params, counts, [eos_token_id] * len(params))
    greedy_targets = argmax_rows(masked).tolist()
    out: list[list[int]] = []
    random_first: list[int] = []  # first row of each random request, in `random_reqs` order
    random_reqs: list[int] = []
    row = 0
    for i, r in enumerate(requests):
        k = len(r.drafts)
        if is_greedy(r.params):
            tokens = []
            for j in range(k + 1):
                target = greedy_targets[row + j]
                tokens.append(target)
                if j == k or r.drafts[j] != target:
                    break
            out.append(tokens)
        else:
            out.append([])
            random_reqs.append(i)
            random_first.append(row)
        row += k + 1
    if random_reqs:
        _rejection_sample(masked, requests, random_reqs, random_first, out)
    logprobs = None
    if any(r.params.logprobs is not None for r in requests):
        row_tokens = []
        for r, tokens in zip(requests, out):
            row_tokens += tokens + [0] * (len(r.drafts) + 1 - len(tokens))
        per_row = compute_logprobs(raw, params, row_tokens)
        logprobs, row = [], 0
        for r, tokens in zip(requests, out):
            logprobs.append(per_row[row : row + len(tokens)] if r.params.logprobs is not None
                            else [])  # fmt: skip
            row += len(r.drafts) + 1
    return SpecResult(out, logprobs)


def target_probs(masked: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution the plain sampler draws from, per row of min_tokens-masked logits
    (``Sampler``'s order and rules: the same function)."""
    return sampling_probs(masked, params)


def _rejection_sample(
    masked: torch.Tensor,
    requests: list[SpecRequest],
    random_reqs: list[int],
    random_first: list[int],
    out: list[list[int]],
) -> None:
    device = masked.device
    rows, row_params = [], []
    for i, first in zip(random_reqs, random_first):
        n = len(requests[i].drafts) + 1
        rows += range(first, first + n)
        row_params += [requests[i].params] * n
    probs = target_probs(masked.index_select(0, list_to_device(rows, device)), row_params)
    # p(draft) of every drafted position, read in one go
    draft_rows, draft_ids = [], []
    local = 0
    for i in random_reqs:
        drafts = requests[i].drafts
        draft_rows += range(local, local + len(drafts))
        draft_ids += drafts
        local += len(drafts) + 1
    p_draft = []
    if draft_rows:
        p_draft = probs[list_to_device(draft_rows, device), list_to_device(draft_ids, device)]
        p_draft = p_draft.tolist()
    q_draft = _draft_mass(requests, random_reqs)
    draw_rows, removed, uniforms = [], [], []
    local = taken = 0
    for i in random_reqs:
        r = requests[i]
        key = r.params.seed if r.params.seed is not None else r.stream_key
        accept_key = mix_seed(key, _ACCEPT_STREAM)
        k = len(r.drafts)
        j = 0
        # keep d with probability min(1, p(d) / q(d))
        while (
            j < k
            and uniform_for(accept_key, r.position + j) * q_draft[taken + j] < p_draft[taken + j]
        ):
            j += 1
        out[i] = list(r.drafts[:j])
        draw_rows.append(local + j)
        removed.append(j if j < k else -1)  # the rejected draft's index
        uniforms.append(uniform_for(key, r.position + j))
        local += k + 1
        taken += k
    dist = probs.index_select(0, list_to_device(draw_rows, device))
    point = [m for m, j in enumerate(removed) if j >= 0 and requests[random_reqs[m]].draft_probs
             is None]  # fmt: skip
    if any(j >= 0 for j in removed):
        dist = dist.clone()
    if point:  # a rejected point-mass draft leaves the support
        ids = [requests[random_reqs[m]].drafts[removed[m]] for m in point]
        dist[list_to_device(point, device), list_to_device(ids, device)] = 0.0
    for m, j in enumerate(removed):
        q = requests[random_reqs[m]].draft_probs
        if j >= 0 and q is not None:  # the residual max(p - q, 0)
            residual = (dist[m] - q[j].to(dist.dtype)).clamp_(min=0.0)
            if float(residual.sum()) > 0.0:
                dist[m] = residual
    drawn = inverse_cdf(dist, uniforms).tolist()
    for i, token in zip(random_reqs, drawn):
        out[i].append(token)


def _draft_mass(requests: list[SpecRequest], random_reqs: list[int]) -> list[float]:
    """q(d) of every drafted position of the random requests, in order: 1.0 for point
    masses."""
    mass: list[float] = []
    for i in random_reqs:
        r = requests[i]
        k = len(r.drafts)
        if r.draft_probs is None:
            mass += [1.0] * k
        elif k:
            q = r.draft_probs
            rows = torch.arange(k, device=q.device)
            mass += q[rows, list_to_device(r.drafts, q.device, torch.long)].tolist()
    return mass


def inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Per row the first token whose cumulative (unnormalised) mass exceeds
    ``u * total``; never a zero-probability token."""
    vocab_size = probs.shape[1]
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = list_to_device(uniforms, probs.device, torch.float64).unsqueeze(1)
    target = torch.minimum(
        (u * total.double()).to(probs.dtype), torch.nextafter(total, torch.zeros_like(total))
    )
    chosen = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab_size - 1)
    valid = probs.gather(1, chosen) > 0
    return torch.where(valid, chosen, probs.argmax(dim=-1, keepdim=True)).squeeze(1)
