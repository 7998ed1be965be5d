"""Structured outputs in the sampler: the grammar's token bitmask applied to logits rows.

    bitmask  int32 [R, ceil(V / 32)]   row r: the allowed tokens of logits row rows[r]
    logits   [N, V]                    rows[r] gets -inf wherever its bit is 0

A request verifying ``k`` drafts (speculative decoding) has ``1 + k`` rows, one per verified
position, and its id ``1 + k`` times in the step's ``req_ids``; ``GrammarRows.for_verified``
lines them up with the verifier's logits (``workers/sampling/spec_verify.py``).

The bitmask is filled on the host by the requests' grammar matchers
(``scheduler/structured_grammar.py``) and travels in ``SchedulerOutput.grammar_bitmask``;
``GrammarRows.from_step`` lines it up with the step's sampled rows. The sampler calls
``apply_grammar_mask`` first, before the min_tokens mask, penalties and temperature, and
only when some row is constrained: an unconstrained batch pays nothing. On CPU numpy unpacks
the bits; on CUDA the words are copied to the device (queued, no host wait) and unpacked there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tandem.kernels.metadata import host_to_device, list_to_device


@dataclasses.dataclass(slots=True)
class GrammarRows:
    rows: list[int]  # logits rows that are constrained
    bitmask: np.ndarray  # int32 [len(rows), words]

    @classmethod
    def from_step(cls, grammar, sampled_req_ids: list[str]) -> GrammarRows | None:
        """``grammar``: a ``scheduler.messages.GrammarBitmask`` (or None)."""
        if grammar is None or not grammar.req_ids:
            return None
        row_of = {rid: row for row, rid in enumerate(sampled_req_ids)}
        words = np.frombuffer(bytearray(grammar.bitmask), dtype=np.int32).reshape(
            len(grammar.req_ids), -1
        )
        rows, keep = [], []
        for k, rid in enumerate(grammar.req_ids):
            row = row_of.get(rid)
            if row is not None:
                rows.append(row)
                keep.append(k)
        if not rows:
            return None
        return cls(rows, np.ascontiguousarray(words[keep]) if len(keep) != len(words) else words)

    @classmethod
    def for_verified(cls, grammar, req_ids: list[str], num_rows: list[int]) -> GrammarRows | None:
        """Speculative decoding: the rows of the verifier's logits (request ``i`` owns
        ``num_rows[i]`` consecutive rows, drafts + 1) that a constrained request's mask
        covers. Such a request has one bitmask row per verified position, its id repeated
        in ``grammar.req_ids`` in position order."""
        if grammar is None or not grammar.req_ids:
            return None
        first: dict[str, int] = {}
        count: dict[str, int] = {}
        for k, rid in enumerate(grammar.req_ids):
            first.setdefault(rid, k)
            count[rid] = count.get(rid, 0) + 1
        rows, keep = [], []
        offset = 0
        for rid, n in zip(req_ids, num_rows, strict=True):
            if rid in first:
                if count[rid] != n:
                    raise ValueError(f"{rid}: {count[rid]} grammar rows for {n} positions")
                rows += range(offset, offset + n)
                keep += range(first[rid], first[rid] + n)
            offset += n
        if not rows:
            return None
        words = np.frombuffer(bytearray(grammar.bitmask), dtype=np.int32).reshape(
            len(grammar.req_ids), -1
        )
        return cls(rows, np.ascontiguousarray(words[keep]))


_BITS: dict[torch.device, torch.Tensor] = {}
_NEG_INF: dict[torch.device, torch.Tensor] = {}


def _bit_positions(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return bits


def _neg_inf(device: torch.device) -> torch.Tensor:
    value = _NEG_INF.get(device)
    if value is None:
        value = _NEG_INF[device] = torch.tensor(float("-inf"), device=device)
    return value


def allowed_tokens(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab_size]`` bool, True where the bitmask allows the token (tokens past the
    bitmask: never). On CPU numpy unpacks the bits (one C pass); on CUDA the words travel and
    are unpacked on the device."""
    width = bitmask.shape[1] * 32
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
    else:
        words = host_to_device(torch.from_numpy(bitmask), device)
        allowed = ((words.unsqueeze(-1) >> _bit_positions(device)) & 1).bool().flatten(1)
    if width < vocab_size:
        pad = torch.zeros((allowed.shape[0], vocab_size - width), dtype=torch.bool, device=device)
        return torch.cat((allowed, pad), dim=1)
    return allowed[:, :vocab_size]


def apply_grammar_mask(logits: torch.Tensor, grammar: GrammarRows) -> torch.Tensor:
    """``logits`` ([N, V] float) with every token a constrained row's grammar forbids at
    -inf; a new tensor (the raw logits stay for logprobs). One ``where`` pass over the
    constrained rows."""
    device = logits.device
    allowed = allowed_tokens(grammar.bitmask, logits.shape[1], device)
    if grammar.rows == list(range(logits.shape[0])):
        return torch.where(allowed, logits, _neg_inf(device))
    rows = list_to_device(grammar.rows, device)
    masked = logits.clone()
    masked.index_copy_(
        0, rows, torch.where(allowed, logits.index_select(0, rows), _neg_inf(device))
    )
    return masked
