"""How the torch reference batches one step's sequences into few SDPA calls.

CPU SDPA has a fixed cost per call (~0.1 ms), so sequences are packed into padded groups::

    group of P sequences, each padded to the group's longest query (Q) and context (W blocks)

    query rows   [P * Q]            token_idx   (padding rows repeat the sequence's last token)
    K/V          [P, Hkv, W*bs, D]  block_ids   (one index_select per K and V; padded by block 0)
    mask         [P, 1, Q, W*bs]    key <= row position (None when nothing needs masking)
    output       [P * Q] -> rows valid_pos -> out[out_idx]

Decodes (query_len == 1) and short queries form groups whose padding is bounded by
``MAX_PADDING``; long queries (> ``SHORT_QUERY_LEN``) get an SDPA call each, plain causal when
they have no prefix so the kernel skips the upper triangle.

The plan depends only on the metadata and the block size; it is computed once per step and
cached in ``meta.derived`` for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.kernels.metadata import AttentionMetadata

SHORT_QUERY_LEN = 64  # longer queries get an SDPA call of their own
MAX_PADDING = 1.5  # a group may compute at most this many scores per useful score


Rows = torch.Tensor | slice  # row indices; a slice when they are consecutive (no copy)


@dataclass
class Group:
    """Sequences sharing one gather and one SDPA call."""

    num_seqs: int
    query_len: int  # Q, rows per sequence after padding
    token_idx: Rows  # [P * Q] query rows
    valid_pos: torch.Tensor | None  # rows of the [P * Q] result that are real; None = all
    out_idx: Rows  # output rows of the valid results
    block_ids: torch.Tensor  # [P * W] int64
    mask: torch.Tensor | None  # [P, 1, Q, W * block_size] bool, True = attend


@dataclass
class LongQuery:
    """One sequence with a long query, attended on its own over its exact context."""

    q_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [query_len, seq_len] bool; None = plain causal (no prefix)


@dataclass
class Plan:
    groups: list[Group]
    long_queries: list[LongQuery]
    num_query_tokens: int


def get_plan(meta: AttentionMetadata, block_size: int) -> Plan:
    """The step's plan, built on first use and cached on ``meta``."""
    key = ("attention_plan", block_size)
    plan = meta.derived.get(key)
    if plan is None:
        plan = meta.derived[key] = _build(meta, block_size)
    return plan


def _split(seq_ids: np.ndarray, query_lens: np.ndarray, widths: np.ndarray) -> list[np.ndarray]:
    """Pack sequences into groups whose padded score count stays under MAX_PADDING x useful.

    Kept in the original order when one group already pads little (the common decode step).
    """
    q, w = query_lens[seq_ids], widths[seq_ids]
    if int(q.max()) * int(w.max()) * len(seq_ids) <= MAX_PADDING * int((q * w).sum()):
        return [seq_ids]
    order = seq_ids[np.argsort(-(q * w), kind="stable")]
    groups, current = [], [int(order[0])]
    max_q, max_w = int(query_lens[order[0]]), int(widths[order[0]])
    useful = max_q * max_w
    for s in order[1:].tolist():
        new_q, new_w = max(max_q, int(query_lens[s])), max(max_w, int(widths[s]))
        new_useful = useful + int(query_lens[s]) * int(widths[s])
        if new_q * new_w * (len(current) + 1) <= MAX_PADDING * new_useful:
            current.append(s)
            max_q, max_w, useful = new_q, new_w, new_useful
        else:
            groups.append(np.asarray(current))
            current = [s]
            max_q, max_w = int(query_lens[s]), int(widths[s])
            useful = max_q * max_w
    groups.append(np.asarray(current))
    return groups


@dataclass
class _Step:
    """Host copies of one step's per-sequence arrays."""

    seq_lens: np.ndarray
    query_lens: np.ndarray
    starts: np.ndarray  # first query row of each sequence
    widths: np.ndarray  # blocks each sequence's context spans
    block_tables: np.ndarray
    block_size: int
    device: torch.device

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def rows(self, index: np.ndarray) -> Rows:
        first = int(index[0])
        if (index == np.arange(first, first + len(index))).all():
            return slice(first, first + len(index))
        return self.to_device(index)


def _build(meta: AttentionMetadata, block_size: int) -> Plan:
    seq_lens = np.asarray(meta.seq_lens_list, dtype=np.int64)
    query_lens = np.asarray(meta.query_lens_list, dtype=np.int64)
    starts = np.zeros(len(seq_lens), dtype=np.int64)
    np.cumsum(query_lens[:-1], out=starts[1:])
    widths = (seq_lens + block_size - 1) // block_size
    block_tables = meta.block_tables.cpu().numpy()
    step = _Step(
        seq_lens, query_lens, starts, widths, block_tables, block_size, meta.block_tables.device
    )

    groups = []
    for short in (query_lens == 1, (query_lens > 1) & (query_lens <= SHORT_QUERY_LEN)):
        seq_ids = np.flatnonzero(short)
        if len(seq_ids):
            groups += [_group(step, ids) for ids in _split(seq_ids, query_lens, widths)]

    long_queries = []
    for i in np.flatnonzero(query_lens > SHORT_QUERY_LEN).tolist():
        seq_len, query_len = int(seq_lens[i]), int(query_lens[i])
        mask = None
        if query_len != seq_len:
            q_pos = np.arange(seq_len - query_len, seq_len)
            mask = step.to_device(np.arange(seq_len)[None, :] <= q_pos[:, None])
        table = step.to_device(block_tables[i, : widths[i]].astype(np.int64))
        long_queries.append(LongQuery(int(starts[i]), query_len, seq_len, table, mask))
    return Plan(groups, long_queries, int(query_lens.sum()))


def _group(step: _Step, ids: np.ndarray) -> Group:
    q_lens, s_lens = step.query_lens[ids], step.seq_lens[ids]
    max_q, width = int(q_lens.max()), int(step.widths[ids].max())
    rows = np.minimum(np.arange(max_q)[None, :], q_lens[:, None] - 1)  # [P, Q], padding clamped
    token_idx = (step.starts[ids][:, None] + rows).reshape(-1)
    q_pos = (s_lens - q_lens)[:, None] + rows
    key_pos = np.arange(width * step.block_size)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [P, Q, W * bs]
    valid = (np.arange(max_q)[None, :] < q_lens[:, None]).reshape(-1)
    return Group(
        num_seqs=len(ids),
        query_len=max_q,
        token_idx=step.rows(token_idx),
        valid_pos=None if valid.all() else step.to_device(np.flatnonzero(valid)),
        out_idx=step.rows(token_idx[valid]),
        block_ids=step.to_device(step.block_tables[ids, :width].astype(np.int64).reshape(-1)),
        mask=None if mask.all() else step.to_device(mask[:, None]),
    )
