"""One step's batch: planned per request on the loop thread, flattened where it runs.

``ModelRunner.launch`` turns a ``SchedulerOutput`` into a ``StepPlan`` from the runner's
own copy of each request (host data only, copied, so the loop thread can plan the next
step while this one runs); ``flatten`` lays the segments out in the order the forward
wants (``workers/runner/model_runner.py``: dense decode rows first on CPU):

    segments    a (prefill chunk 5..7)   b (decode, token in flight)   c (decode)
    input_ids   [a5 a6 a7]               [PLACEHOLDER]                 [c4]
    positions   [5 6 7]                  [9]                           [4]
    scatter     b's id <- row 1 of the previous step's sampled tokens (on the device)

A token sampled by a step still in flight is ``PLACEHOLDER`` in the request's token list
until the loop reads that step's tokens; the step that consumes it copies it from the
previous step's sampled-token tensor on the device, so no host round trip sits between
two steps.
"""

from __future__ import annotations

from tandem.wire.engine_protocol import Logprobs, SamplingParams
from tandem.workers.sampling.grammar_mask import GrammarRows
from tandem.workers.sampling.state import BatchExtras

PLACEHOLDER = -1  # a token id not known on the host yet


class Segment:
    """One request's tokens in a step."""

    __slots__ = ("req_id", "token_ids", "start", "block_ids", "pending_row", "prompt")

    def __init__(
        self,
        req_id: str,
        token_ids: list[int],
        start: int,
        block_ids: list[int],
        pending_row: int,
        prompt: tuple[list[int], int, list[Logprobs]] | None,
    ) -> None:
        self.req_id = req_id
        self.token_ids = token_ids  # the query tokens; PLACEHOLDER where pending
        self.start = start  # position of token_ids[0]
        self.block_ids = block_ids  # the blocks covering positions < start + len(token_ids)
        # >= 0: the PLACEHOLDER (always the last query token) is this row of the previous
        # step's sampled tokens
        self.pending_row = pending_row
        # prompt logprobs to collect: (targets, num_top, the request's list to extend)
        self.prompt = prompt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class StepPlan:
    """Everything the device part of a step needs, decided on the loop thread."""

    __slots__ = (
        "req_ids",
        "segments",
        "sample_segments",
        "params",
        "positions",
        "output_counts",
        "stream_keys",
        "extras",
        "copy_block_ids",
        "dense_release",
        "wants_logprobs",
        "grammar",
        "spec",
        "draft_catch_up",
    )

    def __init__(self) -> None:
        self.req_ids: list[str] = []  # as scheduled (the output's order)
        self.segments: list[Segment] = []  # same order
        self.sample_segments: list[int] = []  # segments that sample, in sampled-row order
        # per sampled row, for the sampler
        self.params: list[SamplingParams] = []
        self.positions: list[int] = []
        self.output_counts: list[int] = []
        self.stream_keys: list[int] = []
        self.extras: BatchExtras | None = None
        self.copy_block_ids: list[tuple[int, int]] = []
        self.dense_release: list[str] = []  # requests whose dense decode row goes
        self.wants_logprobs = False
        # structured outputs: the bitmask rows of the constrained sampled rows
        self.grammar: GrammarRows | None = None
        # requests with drafts (workers/runner/spec_step.py), outside sample_segments
        self.spec = None
        # a draft model's catch-up of requests without drafts this step
        # (workers/spec/draft_model.py): (state, req_id, token ids, first position, blocks)
        self.draft_catch_up: list[tuple] = []


class FlatBatch:
    """A step's segments laid out as one token batch."""

    __slots__ = (
        "input_ids",
        "positions",
        "block_tables",
        "seq_lens",
        "query_lens",
        "last_row",
        "first_row",
        "scatter_dst",
        "scatter_src",
    )

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.block_tables: list[list[int]] = []
        self.seq_lens: list[int] = []
        self.query_lens: list[int] = []
        self.first_row: list[int] = []  # per segment (plan order): its first flat row
        self.last_row: list[int] = []  # per segment (plan order): its last flat row
        self.scatter_dst: list[int] = []  # flat rows whose id comes from the device
        self.scatter_src: list[int] = []  # ... from these rows of the previous step's tokens


def flatten(segments: list[Segment], order: list[int]) -> FlatBatch:
    """Lay ``segments`` out in ``order`` (indices into ``segments``)."""
    flat = FlatBatch()
    flat.first_row = [0] * len(segments)
    flat.last_row = [0] * len(segments)
    input_ids, positions = flat.input_ids, flat.positions
    for i in order:
        seg = segments[i]
        n = seg.num_tokens
        first = len(input_ids)
        if n == 1:
            input_ids.append(seg.token_ids[0] if seg.pending_row < 0 else 0)
            positions.append(seg.start)
        else:
            input_ids.extend(seg.token_ids)
            positions.extend(range(seg.start, seg.start + n))
        if seg.pending_row >= 0:
            input_ids[first + n - 1] = 0
            flat.scatter_dst.append(first + n - 1)
            flat.scatter_src.append(seg.pending_row)
        flat.block_tables.append(seg.block_ids)
        flat.seq_lens.append(seg.start + n)
        flat.query_lens.append(n)
        flat.first_row[i] = first
        flat.last_row[i] = first + n - 1
    return flat
