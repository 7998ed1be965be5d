"""The model runner's half of speculative decoding: plan a request's drafts into its
segment, verify them after the forward, and apply the result to the runner's copy.

    segment      [t d1 d2 d3] at positions n-1 .. n+2 (one multi-token query: the
                 paged attention path takes it as it takes a prefill chunk; the CPU
                 dense decode rows and CUDA's decode graphs take single tokens only, so
                 such a step runs the paged kernels eagerly, or CUDA's piecewise graphs)
    logits       its 4 rows (in the step's one LM-head pass) -> spec_verify.verify
    output       accepted drafts + the target's token: 1 .. 4 tokens
    after        runner state: tokens appended, computed = n + accepted, block table cut
                 to the computed tokens (the scheduler frees the same tail blocks,
                 scheduler/spec/lookahead.py)

Speculative steps run in the synchronous loop only (``EngineCore`` does not start the
overlapped loop with a speculative config): a step's token count is known only once it
is verified, which the overlapped loop's placeholders cannot express.
"""

from __future__ import annotations

from typing import Any

from tandem.workers.sampling.grammar_mask import GrammarRows
from tandem.workers.sampling.spec_verify import SpecRequest, SpecResult


class SpecPlan:
    """A step's requests with drafts: their segments (indices into the plan's) and
    what verification needs of each."""

    __slots__ = ("segments", "states", "requests", "grammar")

    def __init__(self) -> None:
        self.segments: list[int] = []
        self.states: list[Any] = []  # the runner's ReqState of each
        self.requests: list[SpecRequest] = []
        self.grammar: GrammarRows | None = None  # constrained requests' rows, per position

    def take_grammar(self, grammar, req_ids: list[str]) -> None:
        """The step's ``GrammarBitmask`` rows of the requests with drafts (``req_ids``: the
        plan's segment ids): one per verified position, applied in ``verify``."""
        self.grammar = GrammarRows.for_verified(
            grammar, [req_ids[i] for i in self.segments], [len(r.drafts) + 1 for r in self.requests]
        )

    def add(self, segment: int, state: Any, drafts: list[int], stream_key: int) -> None:
        num_tokens = len(state.token_ids)
        self.segments.append(segment)
        self.states.append(state)
        self.requests.append(
            SpecRequest(
                list(drafts), state.params, num_tokens, num_tokens - state.num_prompt, stream_key
            )
        )


def verified_rows(spec: SpecPlan, first_row: list[int], last_row: list[int]) -> list[int]:
    """Flat rows of every verified position: all rows of each draft segment, in order
    (their logits go to ``workers/sampling/spec_verify.verify``)."""
    rows: list[int] = []
    for i in spec.segments:
        rows += range(first_row[i], last_row[i] + 1)
    return rows


def apply_result(spec: SpecPlan, result: SpecResult, block_size: int) -> None:
    """The runner's copy after verification: accepted tokens known, rejected drafts'
    KV forgotten (``num_computed``) and their tail blocks dropped from the table."""
    for st, req, tokens in zip(spec.states, spec.requests, result.token_ids, strict=True):
        num_computed = req.position + len(tokens) - 1  # last token + accepted drafts
        st.token_ids.extend(tokens)
        st.num_computed = num_computed
        # a draft model's KV: valid for the accepted drafts it was fed (draft_model.py)
        st.draft_computed = min(st.draft_computed, num_computed)
        del st.block_ids[-(-num_computed // block_size) :]
