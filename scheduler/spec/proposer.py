"""Proposers: who drafts the tokens a speculative step verifies.

    Proposer.propose(token_ids, max_drafts) -> drafts (0 .. max_drafts tokens)

The scheduler asks the proposer once per step for each request that may speculate
(``can_speculate``), schedules the drafts as lookahead tokens after the request's last
token, and the model runner verifies them in the step's one forward
(``workers/runner/spec_step.py``). Every proposer goes through that one path; only where
the drafts come from differs:

- ``NgramProposer`` (here): prompt lookup, pure host code on the request's own tokens.
- ``ModelDraftSlots`` (here) for model-based proposers: the scheduler decides how many
  drafts a request gets (the same cap, budget and limits as n-gram drafts) and schedules
  that many ``MODEL_DRAFT`` slots, whose KV slots it allocates as for any draft; the model
  runner fills them at the start of the step, before the verification forward
  (``workers/spec/draft_model.py`` runs the draft model's proposal steps there), and
  verifies them in the same forward. The draft's KV writes land in the slots the step
  owns, so no block is held past the computed tokens between steps. EAGLE heads and MTP
  layers plug in at the same place (the runner's ``drafter``), reading the target's
  hidden states kept from the step before.

Either way the drafts reach the verifier through ``SchedulerOutput.scheduled_spec_decode_
tokens``, and acceptance, freeing rejected slots and the metrics are one path.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tandem.scheduler.request import Request
from tandem.scheduler.spec.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """At most ``max_drafts`` tokens likely to follow ``token_ids`` (may be none)."""
        ...


class NgramProposer:
    """Prompt lookup: the longest suffix of the tokens (``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens) that occurred before; the tokens that followed its most
    recent earlier occurrence are the drafts.

        tokens   ... a b c d e ... x a b c | <- suffix "a b c" seen before
        drafts                               d e ...

    ``propose_for`` keeps an index per request (``Request.ngram_index``): every n-gram of
    its tokens -> where its most recent occurrence ends, extended by the tokens appended
    since the last lookup. A lookup then costs a few dictionary reads whatever the
    request's length, where scanning the tokens costs tens of microseconds per request
    and step (a third of a 1.8 ms decode step at batch 32 on an H200). ``propose`` scans
    a bare token list (the same answer, no state).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose_for(self, req: Request, max_drafts: int) -> list[int]:
        tokens = req.all_token_ids
        index = req.ngram_index
        if index is None or index.num_indexed > len(tokens):
            index = req.ngram_index = NgramIndex(self.min_n, self.max_n)
        # occurrences that end before the last token: the suffix itself ends there
        index.extend(tokens, len(tokens) - 1)
        if max_drafts <= 0:
            return []
        start = index.follower(tokens)
        return [] if start < 0 else tokens[start : start + max_drafts]

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_drafts <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # every earlier end of a match is an earlier occurrence of the last token
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if not ends.size:
            return []
        # how far back each occurrence matches the suffix, up to max_n
        matched = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for m in range(1, min(self.max_n, num_tokens - 1)):
            back = ends - m
            alive &= back >= 0
            alive[alive] = tokens[back[alive]] == tokens[-1 - m]
            if not alive.any():
                break
            matched += alive
        best = min(int(matched.max()), self.max_n)
        if best < self.min_n:
            return []
        start = int(ends[np.flatnonzero(matched >= best)[-1]]) + 1
        return token_ids[start : start + max_drafts]


class NgramIndex:
    """One request's n-grams (``min_n`` .. ``max_n`` tokens) -> the position where the most
    recent of their occurrences ends, over the positions ``< num_indexed``."""

    __slots__ = ("min_n", "max_n", "ends", "num_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions ``num_indexed .. upto - 1``."""
        ends, lo, hi = self.ends, self.min_n, self.max_n
        for end in range(self.num_indexed, upto):
            for n in range(lo, min(hi, end + 1) + 1):
                ends[tuple(tokens[end - n + 1 : end + 1])] = end
        self.num_indexed = max(self.num_indexed, upto)

    def follower(self, tokens: list[int]) -> int:
        """Where the tokens after the longest indexed suffix's latest occurrence start
        (-1: no suffix of ``min_n`` tokens or more occurred)."""
        num = len(tokens)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[num - n :]))
            if end is not None:
                return end + 1
        return -1


# a draft slot the model runner fills (workers/spec/draft_model.py)
MODEL_DRAFT = -1


class ModelDraftSlots:
    """The scheduler's side of a model-based proposer: ``max_drafts`` slots, each a
    ``MODEL_DRAFT`` the runner replaces with a drafted token before verifying."""

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        return [MODEL_DRAFT] * max(max_drafts, 0)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.uses_draft_model:
        return ModelDraftSlots()
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer")


def can_speculate(request: Request) -> bool:
    """May this request's steps carry drafts? The one place that says so.

    Not for requests whose sampling depends on the tokens sampled before in the same
    step: penalties, logit bias and bad words are applied from the runner's per-request
    token counts, one position per step (``workers/sampling/state.py``); such requests
    decode one token per step, with exactly the plain engine's output. Nor for a request
    still collecting its prompt's logprobs, nor a fork parent (it never samples).
    A constrained request (structured outputs) drafts: its drafts are cut where its grammar
    refuses one, and each verified position gets its own mask row
    (``scheduler/structured_grammar.cut_drafts`` and ``bitmask``).
    """
    sp = request.sampling_params
    if request.n > 1 and request.parent_id is None:
        return False
    if sp.prompt_logprobs is not None and request.num_output_tokens == 0:
        return False
    return not (
        sp.presence_penalty
        or sp.frequency_penalty
        or sp.repetition_penalty != 1.0
        or sp.logit_bias
        or sp.bad_words_token_ids
    )
