"""Torch reference of the paged-attention kernels: the CPU path, and the oracle for Triton.

Vectorised for CPU speed (``kernels.attention_plan`` decides the batching). Per call:

* decodes and short queries: per group of similar sequences, one ``index_select`` of their
  blocks into ``[P, Hkv, L, D]`` for K and for V, and one 4-D SDPA call with a causal/length
  mask; decode groups fold GQA as ``[P, Hkv, group, D]`` queries (no K/V repeat);
* each long query (prefill, chunked prefill, prefix hit): one SDPA call over its exact
  context, causal offset by ``seq_len - query_len``.

Gathered rows past a sequence's length are masked out but still multiplied by zero weights,
so the cache must hold finite values everywhere: allocate it with ``torch.zeros``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.attention_plan import Group, LongQuery, get_plan
from tandem.kernels.metadata import AttentionMetadata


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


_GATHER_BUDGET_BYTES = 2 << 20  # K+V gathered per SDPA call in big groups: about L2 size
_MIN_CHUNK_SEQS = 4  # CPU SDPA costs ~0.1 ms per call: never fewer sequences per call


def _gather(
    layer_cache: torch.Tensor, kv: int, block_ids: torch.Tensor, num_seqs: int
) -> torch.Tensor:
    """K (kv=0) or V (kv=1) of ``block_ids`` as ``[num_seqs, Hkv, num_positions, D]``."""
    num_kv_heads, head_dim = layer_cache.shape[3], layer_cache.shape[4]
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
    plan = get_plan(meta, layer_cache.shape[2])
    out_dtype = query.dtype
    query = query.to(layer_cache.dtype)

    only = plan.groups[0] if len(plan.groups) == 1 and not plan.long_queries else None
    if only is not None and only.out_idx == slice(0, plan.num_query_tokens):
        out = _attend_group(query, layer_cache, only, scale)  # e.g. a decode-only step
    else:
        # Every row below num_query_tokens is written by exactly one group or long query.
        out = query.new_empty(plan.num_query_tokens, num_heads, head_dim)
        for group in plan.groups:
            rows = _attend_group(query, layer_cache, group, scale)
            if isinstance(group.out_idx, slice):
                out[group.out_idx] = rows
            else:
                out.index_copy_(0, group.out_idx, rows)
        for long_query in plan.long_queries:
            _attend_long(query, layer_cache, long_query, scale, out)
    if out.shape[0] < num_tokens:
        out = torch.cat([out, out.new_zeros(num_tokens - out.shape[0], num_heads, head_dim)])
    return out.to(out_dtype)


def _attend_group(
    query: torch.Tensor, layer_cache: torch.Tensor, group: Group, scale: float
) -> torch.Tensor:
    """Attention rows of one group, ``[valid rows, Hq, D]`` in ``out_idx`` order."""
    num_seqs, max_q = group.num_seqs, group.query_len
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = layer_cache.shape[3]
    idx = group.token_idx
    q = query[idx] if isinstance(idx, slice) else query.index_select(0, idx)
    if max_q == 1:  # GQA folded: each KV head sees its query heads as `group` query rows
        q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = _sdpa_paged(q, layer_cache, group.block_ids, group.mask, scale, enable_gqa=False)
        return o.reshape(num_seqs, num_heads, head_dim)
    q = q.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)
    gqa = num_heads != num_kv_heads
    o = _sdpa_paged(q, layer_cache, group.block_ids, group.mask, scale, enable_gqa=gqa)
    o = o.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return o if group.valid_pos is None else o.index_select(0, group.valid_pos)


def _sdpa_paged(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """SDPA of ``q`` ``[P, H, R, D]`` over each sequence's ``block_ids`` (``[P * W]``).

    Large groups are done a few sequences at a time through one reused gather buffer, so the
    gathered K/V stay in cache for SDPA instead of a round trip through DRAM.
    """
    num_seqs = q.shape[0]
    width = block_ids.numel() // num_seqs
    _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
    seq_bytes = 2 * width * block_size * num_kv_heads * head_dim * layer_cache.element_size()
    step = max(_MIN_CHUNK_SEQS, _GATHER_BUDGET_BYTES // seq_bytes)
    if step >= num_seqs:
        k = _gather(layer_cache, 0, block_ids, num_seqs)
        v = _gather(layer_cache, 1, block_ids, num_seqs)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    out = q.new_empty(q.shape)
    k_buf = layer_cache.new_empty(step * width, block_size, num_kv_heads, head_dim)
    v_buf = torch.empty_like(k_buf)
    for start in range(0, num_seqs, step):
        end = min(num_seqs, start + step)
        ids = block_ids[start * width : end * width]
        k = torch.index_select(layer_cache[:, 0], 0, ids, out=k_buf[: len(ids)])
        v = torch.index_select(layer_cache[:, 1], 0, ids, out=v_buf[: len(ids)])
        k = k.view(end - start, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(end - start, -1, num_kv_heads, head_dim).transpose(1, 2)
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end],
            k,
            v,
            attn_mask=None if mask is None else mask[start:end],
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return out


def _attend_long(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    long_query: LongQuery,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One long query over its exact context, written into ``out`` in place."""
    start, end = long_query.q_start, long_query.q_start + long_query.query_len
    # 4-D operands: CPU SDPA falls back to its slow math kernel for 3-D ones.
    k = _gather(layer_cache, 0, long_query.block_ids, 1)[:, :, : long_query.seq_len]
    v = _gather(layer_cache, 1, long_query.block_ids, 1)[:, :, : long_query.seq_len]
    q = query[None, start:end].transpose(1, 2)  # [1, Hq, query_len, D]
    o = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=long_query.mask,
        is_causal=long_query.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    out[start:end] = o[0].transpose(0, 1)
