"""Verification graphs: a speculative engine's drafted steps replayed as full CUDA graphs.

A step that verifies drafts gives each request up to Q = ``num_speculative_tokens + 1`` query
tokens (its decode token and the drafts) instead of one, so the decode graphs (one token per
sequence) do not fit it. These graphs are bucketed by the step's TOKEN count T; each holds
up to ``min(T, max_num_seqs)`` sequences and captures attention with queries of up to Q
tokens (the paged kernel's grid and tiles are fixed by Q at capture; the query lengths
themselves are data)::

    drafted step: r0 2 drafts, r1 none, r2 4 drafts      Q = 5, buckets 1 2 4 5 8 10 16 20 ...
    tokens  | r0 t d d | r1 t | r2 t d d d d | pad pad |   T = 10 (8 real)
    query_start_loc  0 3 4 9 9 9 ...  (padding sequences: no query token)

The token buckets are the decode buckets and the decode buckets times Q (``verify_sizes``):
a step with few drafts takes a small bucket, a step where every request drafts Q - 1 takes
the decode bucket of its batch times Q. Any step whose queries are all at most Q tokens
long fits (a short prompt chunk too); longer ones go piecewise or eager, as without these
graphs. Same static-buffer scheme as the decode graphs (``static_inputs.py``: a second
instance, T token rows and S sequence rows); the step then reads the hidden rows it samples
and verifies from the graph's output, exactly as from an eager forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.workers.graphs.runner import static_forward
from tandem.workers.graphs.sizes import bucket_for
from tandem.workers.graphs.static_inputs import StaticDecodeInputs


def verify_sizes(decode_sizes: list[int], query_tokens: int) -> list[int]:
    """Token buckets of the verification graphs: the decode buckets, and each times Q."""
    return sorted(set(decode_sizes) | {size * query_tokens for size in decode_sizes})


@dataclass
class VerifyGraphRunner:
    """Captured forwards of steps whose queries are at most ``query_tokens`` long, per token
    bucket; ``run`` replays one or returns None (the step goes piecewise or eager)."""

    model: torch.nn.Module
    kv_cache: torch.Tensor
    block_size: int
    max_model_len: int
    decode_sizes: list[int]
    query_tokens: int  # Q: num_speculative_tokens + 1
    backend: object
    sizes: list[int] = field(init=False)
    max_seqs: int = field(init=False)
    inputs: StaticDecodeInputs = field(init=False)
    replays: dict[int, Callable[[], torch.Tensor]] = field(init=False, default_factory=dict)
    num_replays: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.query_tokens < 2:
            raise ValueError("verification graphs need queries of at least 2 tokens")
        self.sizes = verify_sizes(self.decode_sizes, self.query_tokens)
        self.max_seqs = max(self.decode_sizes)
        max_blocks = math.ceil(self.max_model_len / self.block_size)
        self.inputs = StaticDecodeInputs(
            self.max_seqs, max_blocks, self.block_size, self.kv_cache.device, self.sizes[-1]
        )

    def seqs_for(self, tokens: int) -> int:
        """Sequence rows of the ``tokens`` bucket."""
        return min(tokens, self.max_seqs)

    def capture(self) -> None:
        """Capture every bucket, largest first, over all-padding inputs (no KV written)."""
        for tokens in reversed(self.sizes):
            seqs = self.seqs_for(tokens)
            self.inputs.fill_queries([], [], [], [], [], seqs, tokens)
            self.replays[tokens] = self.backend.capture(self._forward_fn(seqs, tokens))
            self.num_replays[tokens] = 0

    def _forward_fn(self, seqs: int, tokens: int) -> Callable[[], torch.Tensor]:
        meta = self.inputs.query_metadata(seqs, tokens, self.query_tokens)
        return static_forward(self.model, self.kv_cache, self.inputs, meta, tokens)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        patch_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Hidden states ``[num_tokens, hidden]`` by replay (a view of the graph's output:
        read it before the next ``run``), or None: a query longer than Q, or no bucket."""
        n, total = len(seq_lens), len(input_ids)
        if n == 0 or max(query_lens) > self.query_tokens:
            return None
        tokens = bucket_for(total, self.sizes)
        if tokens is None or tokens not in self.replays or n > self.seqs_for(tokens):
            return None
        self.inputs.fill_queries(
            input_ids, positions, block_tables, seq_lens, query_lens, self.seqs_for(tokens), tokens
        )
        if patch_ids is not None:
            patch_ids(self.inputs.device_view("input_ids", total))
        self.num_replays[tokens] += 1
        return self.replays[tokens]()[:total]
