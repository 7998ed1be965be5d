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
class _DecodePlan:
    """Sequences with query_len == 1, batched into one padded gather."""

    token_idx: torch.Tensor | None  # [B] rows of query/output; None = all rows 0..B-1
    block_ids: torch.Tensor  # [B * num_blocks] int64, flat, padded with 0
    num_blocks: int  # blocks per sequence after padding
    mask: torch.Tensor  # [B, 1, 1, num_blocks * block_size] bool, True = attend


@dataclass
class _PrefillSeq:
    """One sequence with query_len > 1."""

    q_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None = plain causal (no prefix)


def _plan(meta: AttentionMetadata, block_size: int) -> tuple[_DecodePlan | None, list[_PrefillSeq]]:
    """Index tensors for one step, computed once and cached on ``meta`` for every layer."""
    key = ("reference_plan", block_size)
    cached = meta.derived.get(key)
    if cached is not None:
        return cached
    seq_lens, query_lens = meta.seq_lens_list, meta.query_lens_list
    block_tables = meta.block_tables.cpu().long()
    starts = [0] * len(seq_lens)
    for i in range(1, len(seq_lens)):
        starts[i] = starts[i - 1] + query_lens[i - 1]

    decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
    decode = None
    if decode_seqs:
        dec_lens = torch.tensor([seq_lens[i] for i in decode_seqs])
        num_blocks = (int(dec_lens.max()) + block_size - 1) // block_size
        all_rows = len(decode_seqs) == len(seq_lens)  # tokens are then exactly 0..B-1
        seq_idx = torch.tensor(decode_seqs)
        table = block_tables[seq_idx, :num_blocks] if not all_rows else block_tables[:, :num_blocks]
        positions = torch.arange(num_blocks * block_size)
        decode = _DecodePlan(
            token_idx=None if all_rows else torch.tensor([starts[i] for i in decode_seqs]),
            block_ids=table.reshape(-1).contiguous(),
            num_blocks=num_blocks,
            mask=(positions[None, :] < dec_lens[:, None])[:, None, None, :],
        )

    prefills = []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        if query_len <= 1:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        mask = None
        if query_len != seq_len:
            q_pos = torch.arange(seq_len - query_len, seq_len)
            mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        prefills.append(
            _PrefillSeq(starts[i], query_len, seq_len, block_tables[i, :num_blocks], mask)
        )

    device = meta.block_tables.device
    if device.type != "cpu":
        if decode is not None:
            decode = _DecodePlan(
                token_idx=None if decode.token_idx is None else decode.token_idx.to(device),
                block_ids=decode.block_ids.to(device),
                num_blocks=decode.num_blocks,
                mask=decode.mask.to(device),
            )
        for p in prefills:
            p.block_ids = p.block_ids.to(device)
            p.mask = None if p.mask is None else p.mask.to(device)
    meta.derived[key] = (decode, prefills)
    return decode, prefills


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
    decode, prefills = _plan(meta, block_size)
    out_dtype = query.dtype
    query = query.to(layer_cache.dtype)

    if decode is not None and decode.token_idx is None and not prefills:
        num_seqs = decode.mask.shape[0]
        out = _decode(query[:num_seqs], layer_cache, decode, scale, group)
        if num_seqs < num_tokens:
            out = torch.cat([out, out.new_zeros(num_tokens - num_seqs, num_heads, head_dim)])
        return out.to(out_dtype)

    out = query.new_zeros(num_tokens, num_heads, head_dim)
    if decode is not None:
        q = query if decode.token_idx is None else query.index_select(0, decode.token_idx)
        q = q[: decode.mask.shape[0]]
        rows = _decode(q, layer_cache, decode, scale, group)
        if decode.token_idx is None:
            out[: rows.shape[0]] = rows
        else:
            out.index_copy_(0, decode.token_idx, rows)
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
    query: torch.Tensor, layer_cache: torch.Tensor, plan: _DecodePlan, scale: float, group: int
) -> torch.Tensor:
    """One query row per sequence; GQA folded so each KV head sees ``group`` query rows."""
    num_seqs, num_heads, head_dim = query.shape
    k = _gather(layer_cache, 0, plan.block_ids, num_seqs)
    v = _gather(layer_cache, 1, plan.block_ids, num_seqs)
    q = query.view(num_seqs, num_heads // group, group, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)
