"""Prefix-free prefills attend with SDPA on their own K/V; every other query reads the paged cache.

A sequence whose query is its whole context (``query_len == seq_len``: a new prompt without a
prefix-cache hit or an earlier chunk) needs nothing from the cache: its keys and values are this
step's own rows. Those sequences take torch's dense causal kernels; the rest of the step
(decodes, later chunks, prefix hits) keeps the paged kernel::

    tokens  | s0 decode | s1 prompt (12) | s2 chunk 2 of 3 (8) | s3 prompt (5) |
    fresh                   rows 1..12                            rows 21..25    -> causal SDPA
    paged     row 0                        rows 13..20                           -> paged_attention
    out       every row written once, in step order (padding rows past the queries: zero)

The models write every token's K/V to the cache before attending (``rope_write_kv``), so later
steps find the fresh sequences' keys there as usual.

The fresh sequences of a step run in one of two ways:

* ``flash_varlen`` (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256): ONE launch for all of
  them, ``aten::_flash_attention_forward`` with cumulative lengths over the packed rows. It is the
  FlashAttention-2 kernel behind torch's SDPA, the call torch's own jagged nested-tensor SDPA
  makes; it takes K/V with fewer heads than Q (GQA) as they are, where nested-tensor SDPA
  refuses ``enable_gqa`` and would need K/V repeated per query head.
* ``sdpa_groups`` (fp32, CPU, head dims flash cannot take, or flash missing): one
  ``scaled_dot_product_attention(is_causal=True)`` call per group of equal-length sequences,
  batched as ``[P, H, L, D]`` (a view when their rows are consecutive).

``AttentionMetadata.sdpa_prefills`` switches the split on (the model runner sets it from
``EngineConfig.graphs.prefill_attention``, see ``use_sdpa_prefills``); the plan is built once per step
and cached in ``meta.derived`` for every layer.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.kernels.dispatch import paged_attention
from tandem.kernels.metadata import AttentionMetadata, host_to_device

logger = logging.getLogger(__name__)

MODES = ("auto", "triton", "sdpa")
# Layer calls per way of attending the fresh sequences (tests and benchmarks read it).
NUM_CALLS: Counter = Counter()

Rows = torch.Tensor | slice  # row indices; a slice when they are consecutive (no copy)


def use_sdpa_prefills(mode: str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a step's prefix-free prefills take SDPA, for ``EngineConfig.graphs.prefill_attention``.

    ``triton``: never (every query through ``kernels.dispatch.paged_attention``); ``sdpa``:
    always; ``auto``: the paged Triton kernel everywhere. Measured on an H200 (2026-11-26,
    ``benchmarks/prefill_attention.py``, bf16, two runs): the split's varlen flash call was
    slower than the paged kernel at 512 and 1024-token prompts (81-91 vs 112-118 and 117-124 vs
    119-150 TFLOP/s), level at 128, 2048 and mixed lengths, and ahead only at 4096 (217-243 vs
    168-189). (Batched SDPA over equal lengths beat both from 512 up: the next measurement.)
    On CPU the reference path already attends long prompts with SDPA.
    """
    if mode not in MODES:
        raise ValueError(f"prefill_attention must be one of {', '.join(MODES)}, got {mode!r}")
    torch.device(device)  # validates the device argument for every mode
    del dtype  # auto no longer depends on it (docstring)
    return mode == "sdpa"


@dataclass
class FreshGroup:
    """Fresh sequences of one length, attended by one batched SDPA call."""

    length: int
    num_seqs: int
    rows: Rows  # rows of the packed fresh tokens, sequence by sequence


@dataclass
class PrefillSplit:
    num_query_tokens: int
    fresh_rows: Rows  # step rows of the fresh sequences' tokens, in step order (= packed order)
    cu_seqlens: torch.Tensor  # [num_fresh + 1] int32: offsets of each fresh sequence when packed
    max_len: int
    groups: list[FreshGroup]
    paged_rows: Rows | None  # step rows of every other sequence; None when there are none
    paged: AttentionMetadata | None  # those sequences' metadata


def get_split(meta: AttentionMetadata) -> PrefillSplit | None:
    """The step's split, cached on ``meta``; None when it is off or no sequence is fresh."""
    if not meta.sdpa_prefills:
        return None
    key = "prefill_split"
    if key not in meta.derived:
        meta.derived[key] = _build(meta)
    return meta.derived[key]


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``kernels.dispatch.paged_attention``'s contract, given this step's ``key``/``value``
    ``[T, Hkv, D]`` too (already written to ``layer_cache``): fresh sequences attend over those,
    the others over the cache. Returns ``[T, Hq, D]`` in ``query``'s dtype."""
    split = get_split(meta)
    if split is None:
        return paged_attention(query, layer_cache, meta, scale)
    num_tokens = query.shape[0]
    everything = slice(0, num_tokens)
    fresh = _attend_fresh(
        _take(query, split.fresh_rows),
        _take(key, split.fresh_rows),
        _take(value, split.fresh_rows),
        split,
        scale,
    )
    if split.paged is None and split.fresh_rows == everything:
        return fresh  # e.g. a prefill engine's step: every prompt is new
    out = query.new_empty(query.shape)
    if split.num_query_tokens < num_tokens:
        out[split.num_query_tokens :].zero_()
    _put(out, split.fresh_rows, fresh)
    if split.paged is not None:
        rest = paged_attention(_take(query, split.paged_rows), layer_cache, split.paged, scale)
        _put(out, split.paged_rows, rest)
    return out


def _attend_fresh(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: PrefillSplit, scale: float
) -> torch.Tensor:
    """Causal attention of the packed fresh rows ``[F, H, D]`` over themselves."""
    if flash_varlen_supported(q, k):
        NUM_CALLS["flash_varlen"] += 1
        return _flash_varlen(q, k, v, split.cu_seqlens, split.max_len, scale)
    NUM_CALLS["sdpa_groups"] += 1
    if len(split.groups) == 1:
        return _attend_group(q, k, v, split.groups[0], scale)
    out = q.new_empty(q.shape)
    for group in split.groups:
        _put(out, group.rows, _attend_group(q, k, v, group, scale))
    return out


def _flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    # Positional: query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    # return_debug_mask (the schema torch 2.3..2.13 share). Only the last dim must be dense.
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale
    )[0]
    return out


def _attend_group(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: FreshGroup, scale: float
) -> torch.Tensor:
    num_seqs, length = group.num_seqs, group.length

    def batched(x: torch.Tensor) -> torch.Tensor:  # [P * L, H, D] rows -> [P, H, L, D]
        x = _take(x, group.rows)
        return x.view(num_seqs, length, x.shape[1], x.shape[2]).transpose(1, 2)

    qb, kb, vb = batched(q), batched(k), batched(v)
    group_size = qb.shape[1] // kb.shape[1]
    gqa = group_size > 1
    if gqa and qb.is_cuda:
        # CUDA SDPA takes enable_gqa only in its flash and math kernels: fp32 would get the math
        # kernel (an L x L score matrix per head); repeated heads reach the efficient kernel.
        kb = kb.repeat_interleave(group_size, dim=1)
        vb = vb.repeat_interleave(group_size, dim=1)
        gqa = False
    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2).reshape(num_seqs * length, q.shape[1], q.shape[2])


_FLASH_OK: dict[tuple, bool] = {}


def flash_varlen_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the varlen flash kernel takes these operands: CUDA, fp16/bf16, head_dim a multiple
    of 8 up to 256, Ampere or newer, torch built with flash. Probed once per shape class by a
    tiny call, so a torch build that lacks it falls back to ``sdpa_groups`` with one warning."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    cache_key = (q.device, q.dtype, head_dim, q.shape[1], k.shape[1])
    ok = _FLASH_OK.get(cache_key)
    if ok is None:
        ok = _FLASH_OK[cache_key] = _probe_flash(
            q.device, q.dtype, head_dim, q.shape[1], k.shape[1]
        )
    return ok


def _probe_flash(
    device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
) -> bool:
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8 or not torch.backends.cuda.is_flash_attention_available():
        return False
    try:
        q = torch.zeros(4, num_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(4, num_kv_heads, head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
        _flash_varlen(q, k, k, cu, 3, 1.0)
    except (RuntimeError, TypeError) as exc:
        logger.warning(
            "varlen flash attention unavailable (%s); prefix-free prefills use SDPA per "
            "equal-length group",
            exc,
        )
        return False
    return True


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(out: torch.Tensor, rows: Rows, values: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = values
    else:
        out.index_copy_(0, rows, values)


def _build(meta: AttentionMetadata) -> PrefillSplit | None:
    seq_lens = np.asarray(meta.seq_lens_list, dtype=np.int64)
    query_lens = np.asarray(meta.query_lens_list, dtype=np.int64)
    is_fresh = seq_lens == query_lens
    if not is_fresh.any():
        return None
    starts = np.zeros(len(seq_lens), dtype=np.int64)
    np.cumsum(query_lens[:-1], out=starts[1:])
    device = meta.slot_mapping.device

    def rows(index: np.ndarray) -> Rows:
        first = int(index[0])
        if (index == np.arange(first, first + len(index))).all():
            return slice(first, first + len(index))
        return host_to_device(torch.from_numpy(np.ascontiguousarray(index)), device)

    def token_rows(seq_ids: np.ndarray) -> np.ndarray:
        lens = query_lens[seq_ids]
        packed_starts = np.cumsum(lens) - lens
        return np.repeat(starts[seq_ids] - packed_starts, lens) + np.arange(int(lens.sum()))

    fresh_ids = np.flatnonzero(is_fresh)
    fresh_lens = query_lens[fresh_ids]
    cu_seqlens = np.zeros(len(fresh_ids) + 1, dtype=np.int32)
    np.cumsum(fresh_lens, out=cu_seqlens[1:])
    groups = []
    for length in dict.fromkeys(fresh_lens.tolist()):  # distinct lengths, first-seen order
        members = np.flatnonzero(fresh_lens == length)
        packed = np.repeat(cu_seqlens[:-1][members].astype(np.int64), length)
        packed += np.tile(np.arange(length), len(members))
        groups.append(FreshGroup(length, len(members), rows(packed)))

    paged_rows = paged = None
    paged_ids = np.flatnonzero(~is_fresh)
    if len(paged_ids):
        paged_rows = rows(token_rows(paged_ids))
        seq_rows = rows(paged_ids)
        paged_query_lens = query_lens[paged_ids]
        query_start_loc = np.zeros(len(paged_ids) + 1, dtype=np.int32)
        np.cumsum(paged_query_lens, out=query_start_loc[1:])
        paged = AttentionMetadata(
            slot_mapping=_take(meta.slot_mapping, paged_rows),
            block_tables=_take(meta.block_tables, seq_rows),
            seq_lens=_take(meta.seq_lens, seq_rows),
            query_start_loc=host_to_device(torch.from_numpy(query_start_loc), device),
            max_query_len=int(paged_query_lens.max()),
            max_seq_len=int(seq_lens[paged_ids].max()),
            seq_lens_list=seq_lens[paged_ids].tolist(),
            query_lens_list=paged_query_lens.tolist(),
        )
    return PrefillSplit(
        num_query_tokens=int(query_lens.sum()),
        fresh_rows=rows(token_rows(fresh_ids)),
        cu_seqlens=host_to_device(torch.from_numpy(cu_seqlens), device),
        max_len=int(fresh_lens.max()),
        groups=groups,
        paged_rows=paged_rows,
        paged=paged,
    )
