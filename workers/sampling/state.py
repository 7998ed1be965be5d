"""Per-request sampling state the model runner keeps for requests that use
penalties, logit bias or bad words, and its gathering into one batch.

Token counts live in two shared buffers, one row per such request:

    prompt_mask    [rows, V] bool   token occurs in the (client's) prompt
    output_counts  [rows, V] int32  occurrences in the output so far

filled once when the runner first sees the request (or sees it again after
preemption) and bumped by one index_put per step for the tokens just
sampled. Requests that use none of the features get no row and cost nothing:
``SamplingExtras.batch`` returns None at once when no tracked request exists.

The prompt/output boundary is ``SamplingParams.num_penalty_prompt_tokens``
when set: a P/D handoff (or a migration) moves earlier output tokens into
the engine request's prompt, but for the penalties they stay output tokens,
so the decode engine penalises exactly as one engine would.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.kernels.metadata import list_to_device
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.sampling.penalties import apply_penalties, banned_last_tokens


def uses_extras(params: SamplingParams) -> bool:
    """True when ``params`` asks for anything ``SamplingExtras`` applies."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.logit_bias
        or params.bad_words_token_ids
    )


def uses_counts(params: SamplingParams) -> bool:
    return bool(
        params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
    )


@dataclasses.dataclass(slots=True)
class _Tracked:
    params: SamplingParams
    row: int  # buffer row, -1 when the request needs no counts
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None


@dataclasses.dataclass(slots=True)
class BatchExtras:
    """What one step applies; rows index the step's logits batch."""

    penalty_rows: torch.Tensor | None = None  # [P] batch rows with penalties
    prompt_mask: torch.Tensor | None = None  # [P, V]
    output_counts: torch.Tensor | None = None  # [P, V]
    repetition: torch.Tensor | None = None  # [P]
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None  # [B] flat (row, id, value) triples
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    ban_rows: list[int] = dataclasses.field(default_factory=list)
    ban_ids: list[int] = dataclasses.field(default_factory=list)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Logit bias, then bad words, then penalties; returns a new tensor."""
        out = logits.clone()
        if self.bias_rows is not None:
            out.index_put_((self.bias_rows, self.bias_ids), self.bias_values, accumulate=True)
        if self.ban_rows:
            out[self.ban_rows, self.ban_ids] = float("-inf")
        if self.penalty_rows is not None:
            rows = out.index_select(0, self.penalty_rows)
            rows = apply_penalties(
                rows,
                self.prompt_mask,
                self.output_counts,
                self.repetition,
                self.frequency,
                self.presence,
            )
            out.index_copy_(0, self.penalty_rows, rows)
        return out


class SamplingExtras:
    """The runner's store of tracked requests (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 4) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._tracked: dict[str, _Tracked] = {}
        self._free_rows: list[int] = []
        self._prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._initial_rows = initial_rows

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    def add(
        self, req_id: str, params: SamplingParams, token_ids: list[int], num_prompt: int
    ) -> bool:
        """Track ``req_id`` if its params need it (replacing earlier state).
        ``token_ids``: prompt + output so far; ``num_prompt``: the engine
        request's prompt length. Returns whether the request is tracked."""
        self.remove(req_id)
        if not uses_extras(params):
            return False
        row = -1
        if uses_counts(params):
            row = self._take_row()
            boundary = _prompt_boundary(params, token_ids, num_prompt)
            ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
            self._prompt_mask[row, ids[:boundary]] = True
            if boundary < len(token_ids):
                counts = torch.bincount(ids[boundary:], minlength=self.vocab_size)
                self._output_counts[row] = counts[: self.vocab_size].to(torch.int32)
        bias_ids = bias_values = None
        if params.logit_bias:
            pairs = [(int(k), float(v)) for k, v in params.logit_bias.items()]
            pairs = [(k, v) for k, v in pairs if 0 <= k < self.vocab_size]
            if pairs:
                bias_ids = torch.tensor([k for k, _ in pairs], device=self.device)
                bias_values = torch.tensor([v for _, v in pairs], device=self.device)
        self._tracked[req_id] = _Tracked(params, row, bias_ids, bias_values)
        return True

    def remove(self, req_id: str) -> None:
        tracked = self._tracked.pop(req_id, None)
        if tracked is not None and tracked.row >= 0:
            self._prompt_mask[tracked.row] = False
            self._output_counts[tracked.row] = 0
            self._free_rows.append(tracked.row)

    def batch(
        self, req_ids: list[str], histories: list[tuple[list[int], int]] | None = None
    ) -> BatchExtras | None:
        """The step's extras for logits rows ``req_ids`` (None: nothing to do).
        ``histories``: per row, (the request's tokens so far, its engine
        request's prompt length); read only for rows that use bad words."""
        if not self._tracked:
            return None
        extras = BatchExtras()
        pen_rows, pen_buf_rows, rep, freq, pres = [], [], [], [], []
        bias_rows, bias_ids, bias_values = [], [], []
        for i, rid in enumerate(req_ids):
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            p = tracked.params
            if tracked.row >= 0:
                pen_rows.append(i)
                pen_buf_rows.append(tracked.row)
                rep.append(p.repetition_penalty)
                freq.append(p.frequency_penalty)
                pres.append(p.presence_penalty)
            if tracked.bias_ids is not None:
                bias_rows.append(torch.full_like(tracked.bias_ids, i))
                bias_ids.append(tracked.bias_ids)
                bias_values.append(tracked.bias_values)
            if p.bad_words_token_ids:
                outputs = _output_tokens(p, *histories[i]) if histories is not None else []
                for token_id in banned_last_tokens(p.bad_words_token_ids, outputs):
                    if 0 <= token_id < self.vocab_size:
                        extras.ban_rows.append(i)
                        extras.ban_ids.append(token_id)
        if not (pen_rows or bias_rows or extras.ban_rows):
            return None
        dev = self.device
        if pen_rows:
            buf_rows = list_to_device(pen_buf_rows, dev)
            extras.penalty_rows = list_to_device(pen_rows, dev)
            extras.prompt_mask = self._prompt_mask.index_select(0, buf_rows)
            extras.output_counts = self._output_counts.index_select(0, buf_rows)
            extras.repetition = list_to_device(rep, dev, torch.float32)
            extras.frequency = list_to_device(freq, dev, torch.float32)
            extras.presence = list_to_device(pres, dev, torch.float32)
        if bias_rows:
            extras.bias_rows = torch.cat(bias_rows)
            extras.bias_ids = torch.cat(bias_ids)
            extras.bias_values = torch.cat(bias_values)
        return extras

    def record(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Count the tokens just sampled (one per request) as output."""
        if not self._tracked:
            return
        rows, ids = [], []
        for rid, token_id in zip(req_ids, token_ids, strict=True):
            tracked = self._tracked.get(rid)
            if tracked is not None and tracked.row >= 0:
                rows.append(tracked.row)
                ids.append(token_id)
        if rows:
            dev = self.device
            one = torch.ones(len(rows), dtype=torch.int32, device=dev)
            index = (list_to_device(rows, dev), list_to_device(ids, dev))
            self._output_counts.index_put_(index, one, accumulate=True)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._prompt_mask.shape[0]
            new = max(self._initial_rows, 2 * old)
            mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
            counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
            mask[:old] = self._prompt_mask
            counts[:old] = self._output_counts
            self._prompt_mask, self._output_counts = mask, counts
            self._free_rows.extend(range(new - 1, old - 1, -1))
        return self._free_rows.pop()

    def check_integrity(self) -> None:
        """Every buffer row is either free (and zero) or owned by one request."""
        owned = [t.row for t in self._tracked.values() if t.row >= 0]
        assert len(set(owned)) == len(owned), "a buffer row has two owners"
        assert not set(owned) & set(self._free_rows), "a tracked row is on the free list"
        assert len(owned) + len(self._free_rows) == self._prompt_mask.shape[0]
        for row in self._free_rows:
            assert not self._prompt_mask[row].any() and not self._output_counts[row].any()


def _prompt_boundary(params: SamplingParams, token_ids: list[int], num_prompt: int) -> int:
    """How many leading ``token_ids`` are the client's prompt."""
    boundary = params.num_penalty_prompt_tokens
    return num_prompt if boundary < 0 else min(boundary, len(token_ids))


def _output_tokens(params: SamplingParams, token_ids: list[int], num_prompt: int) -> list[int]:
    return token_ids[_prompt_boundary(params, token_ids, num_prompt) :]
