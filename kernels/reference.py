"""Torch reference of the paged-attention kernels: the CPU path, and the oracle for Triton.

Vectorised for CPU speed. Per call:

* decode rows (query_len == 1) of all sequences: one ``index_select`` of their blocks into
  ``[B, Hkv, L, D]`` and one SDPA call with a length mask, GQA folded as
  ``[B, Hkv, group, D]`` queries (no K/V repeat);
* every sequence with query_len > 1 (prefill, chunked prefill, prefix hit): one SDPA call over
  its exact context with a causal mask offset by ``seq_len - query_len``.

Gathered rows past a sequence's length are masked out but still multiplied by zero weights,
so the cache must hold finite values everywhere: allocate it with ``torch.zeros``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[num_tokens, Hkv, D]`` into ``layer_cache`` in place.

    ``layer_cache`` is ``[num_blocks, 2, block_size, Hkv, D]`` (any strides); token ``t`` goes
    to slot ``slot_mapping[t]`` (``block * block_size + offset``), -1 skips the token.
    """
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].long()
    if num_tokens and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = layer_cache.shape[2]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    layer_cache[:, 0].index_put_((blocks, offsets), key.to(layer_cache.dtype))
    layer_cache[:, 1].index_put_((blocks, offsets), value.to(layer_cache.dtype))


@dataclass
class _DecodeGroup:
    """Sequences with query_len == 1 and similar lengths, batched into one padded gather."""

    token_idx: torch.Tensor | None  # [B] rows of query/output; None = rows 0..B-1 in order
    block_ids: torch.Tensor  # [B * num_blocks] int64, flat, padded with block 0
    mask: torch.Tensor | None  # [B, 1, 1, num_blocks * block_size] bool; None = attend to all


@dataclass
class _PrefillSeq:
    """One sequence with query_len > 1."""

    q_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None = plain causal (no prefix)


_MAX_PADDING = 1.25  # a decode group may gather at most this many blocks per useful block


def _group_decodes(seq_ids: np.ndarray, num_blocks: np.ndarray) -> list[np.ndarray]:
    """Split decode sequences so padding to each group's longest wastes little.

    One group in the original order when that already pads little; otherwise longest first,
    starting a new group when a sequence needs under 1/_MAX_PADDING of the group's width.
    """
    widths = num_blocks[seq_ids]
    if int(widths.max()) * len(seq_ids) <= _MAX_PADDING * int(widths.sum()):
        return [seq_ids]
    order = np.argsort(-widths, kind="stable")
    groups, start = [], 0
    for i in range(1, len(order)):
        if widths[order[i]] * _MAX_PADDING < widths[order[start]] and i - start >= 4:
            groups.append(seq_ids[order[start:i]])
            start = i
    if not groups:
        return [seq_ids]
    groups.append(seq_ids[order[start:]])
    return groups


def _plan(meta: AttentionMetadata, block_size: int) -> tuple[list[_DecodeGroup], list[_PrefillSeq]]:
    """Index tensors for one step, computed once and cached on ``meta`` for every layer."""
    key = ("reference_plan", block_size)
    cached = meta.derived.get(key)
    if cached is not None:
        return cached
    device = meta.block_tables.device
    seq_lens = np.asarray(meta.seq_lens_list, dtype=np.int64)
    query_lens = np.asarray(meta.query_lens_list, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)
    num_blocks = (seq_lens + block_size - 1) // block_size
    block_tables = meta.block_tables.cpu().numpy()

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    decodes = []
    decode_seqs = np.flatnonzero(query_lens == 1)
    for seq_ids in _group_decodes(decode_seqs, num_blocks) if len(decode_seqs) else []:
        width = int(num_blocks[seq_ids].max())
        lens = seq_lens[seq_ids]
        # Every sequence decodes, in order: its rows are then the tokens 0..B-1.
        in_order = len(seq_ids) == len(seq_lens) and bool((np.diff(seq_ids) > 0).all())
        mask = None
        if (lens != width * block_size).any():
            mask = to_device(
                (np.arange(width * block_size)[None, :] < lens[:, None])[:, None, None]
            )
        decodes.append(
            _DecodeGroup(
                token_idx=None if in_order else to_device(starts[seq_ids]),
                block_ids=to_device(block_tables[seq_ids, :width].astype(np.int64).reshape(-1)),
                mask=mask,
            )
        )

    prefills = []
    for i in np.flatnonzero(query_lens > 1).tolist():
        seq_len, query_len = int(seq_lens[i]), int(query_lens[i])
        mask = None
        if query_len != seq_len:
            q_pos = np.arange(seq_len - query_len, seq_len)
            mask = to_device(np.arange(seq_len)[None, :] <= q_pos[:, None])
        table = block_tables[i, : num_blocks[i]].astype(np.int64)
        prefills.append(_PrefillSeq(int(starts[i]), query_len, seq_len, to_device(table), mask))

    meta.derived[key] = (decodes, prefills)
    return decodes, prefills


def _gather(
    layer_cache: torch.Tensor, kv: int, block_ids: torch.Tensor, num_seqs: int
) -> torch.Tensor:
    """K (kv=0) or V (kv=1) of ``block_ids`` as ``[num_seqs, Hkv, num_positions, D]``."""
    _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
    rows = layer_cache[:, kv].index_select(0, block_ids)
    return rows.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)


def paged_attention(
    query: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of ``query`` ``[num_tokens, Hq, D]`` over the paged cache.

    Returns ``[num_tokens, Hq, D]`` in ``query``'s dtype; rows past ``sum(query_lens)``
    (padding) are zero. See ``kernels.metadata`` for the token/position layout.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    group = num_heads // num_kv_heads
    decodes, prefills = _plan(meta, block_size)
    out_dtype = query.dtype
    query = query.to(layer_cache.dtype)

    if len(decodes) == 1 and decodes[0].token_idx is None:  # decode-only step, one gather
        num_seqs = len(meta.seq_lens_list)
        out = _decode(query[:num_seqs], layer_cache, decodes[0], scale, group)
        if num_seqs < num_tokens:
            out = torch.cat([out, out.new_zeros(num_tokens - num_seqs, num_heads, head_dim)])
        return out.to(out_dtype)

    out = query.new_zeros(num_tokens, num_heads, head_dim)
    for d in decodes:  # token_idx is set: only the early return above takes rows in order
        rows = _decode(query.index_select(0, d.token_idx), layer_cache, d, scale, group)
        out.index_copy_(0, d.token_idx, rows)
    for p in prefills:
        k = _gather(layer_cache, 0, p.block_ids, 1)[0, :, : p.seq_len]
        v = _gather(layer_cache, 1, p.block_ids, 1)[0, :, : p.seq_len]
        q = query[p.q_start : p.q_start + p.query_len].transpose(0, 1)  # [Hq, query_len, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=group > 1
        )
        out[p.q_start : p.q_start + p.query_len] = o.transpose(0, 1)
    return out.to(out_dtype)


def _decode(
    query: torch.Tensor, layer_cache: torch.Tensor, plan: _DecodeGroup, scale: float, group: int
) -> torch.Tensor:
    """One query row per sequence; GQA folded so each KV head sees ``group`` query rows."""
    num_seqs, num_heads, head_dim = query.shape
    k = _gather(layer_cache, 0, plan.block_ids, num_seqs)
    v = _gather(layer_cache, 1, plan.block_ids, num_seqs)
    q = query.view(num_seqs, num_heads // group, group, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)
