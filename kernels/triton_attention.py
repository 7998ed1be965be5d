"""Triton paged attention for a mixed batch (prefills, chunked prefills, decodes) in one launch.

One program per (sequence, KV head, query tile). GQA is folded into the tile: its rows are
(token, query head of this KV head) pairs, so every K/V load serves the whole group::

    row r of the tile  ->  token = tile * TOKENS_PER_TILE + r // GROUP,  head = kv_head * GROUP + r % GROUP

The program walks its sequence's keys BLOCK_N at a time (spanning cache blocks through the block
table, so any block_size works), with an online softmax in fp32. Keys stop at the tile's last
causal position. Dots take the cache dtype (fp32 caches: IEEE, not TF32). Head dims that are
not powers of two are padded to BLOCK_D and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_key_block(
    q,
    m_i,
    l_i,
    acc,
    n_start,
    kv_end,
    q_pos,
    dims,
    dim_valid,
    bt_row_ptr,
    cache_ptr,
    head_offset,
    scale_log2,
    stride_c_block,
    stride_c_kv,
    stride_c_slot,
    stride_c_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Fold keys [n_start, n_start + BLOCK_N) into the online softmax state (m_i, l_i, acc)."""
    pos = n_start + tl.arange(0, BLOCK_N)
    pos_valid = pos < kv_end
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_valid, other=0)
    slot_offsets = block.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot
    slot_offsets += head_offset
    kv_mask = pos_valid[None, :] & dim_valid[:, None]
    k_ptrs = cache_ptr + slot_offsets[None, :] + dims[:, None] * stride_c_dim
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_D, BLOCK_N]
    if DOT_FP32:
        scores = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        scores = tl.dot(q, k)
    causal = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
    scores = tl.where(causal, scores * scale_log2, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = cache_ptr + stride_c_kv + slot_offsets[:, None] + dims[None, :] * stride_c_dim
    v = tl.load(v_ptrs, mask=pos_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_c_block,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    stride_c_dim,
    stride_bt_seq,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_token = tile * TOKENS_PER_TILE
    if first_token < query_len:
        rows = tl.arange(0, BLOCK_M)
        token = first_token + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < TOKENS_PER_TILE * GROUP) & (token < query_len)
        q_pos = seq_len - query_len + token  # causal limit of each row
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM

        q_offsets = (q_start + token).to(tl.int64)[:, None] * stride_q_tok
        q_offsets += head[:, None] * stride_q_head + dims[None, :] * stride_q_dim
        q_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        else:
            q = q.to(cache_ptr.dtype.element_ty)

        last_token = tl.minimum(first_token + TOKENS_PER_TILE, query_len) - 1
        kv_end = seq_len - query_len + last_token + 1  # keys [0, kv_end) matter to this tile

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        head_offset = kv_head * stride_c_head
        bt_row_ptr = block_tables_ptr + seq * stride_bt_seq
        if INTERPRETED:
            # Interpreters of Triton < 3.7 turn a loop bound into a Python int with int() on a
            # one-element array, which NumPy >= 2.4 refuses; a while loop only needs bool().
            n_start = 0
            while n_start < kv_end:
                m_i, l_i, acc = _attend_key_block(
                    q, m_i, l_i, acc, n_start, kv_end, q_pos, dims, dim_valid, bt_row_ptr,
                    cache_ptr, head_offset, scale_log2, stride_c_block, stride_c_kv,
                    stride_c_slot, stride_c_dim, BLOCK_SIZE, BLOCK_N, DOT_FP32,
                )  # fmt: skip
                n_start += BLOCK_N
        else:
            # Compiled: a counted loop, which the compiler software-pipelines.
            for n_start in range(0, kv_end, BLOCK_N):
                m_i, l_i, acc = _attend_key_block(
                    q, m_i, l_i, acc, n_start, kv_end, q_pos, dims, dim_valid, bt_row_ptr,
                    cache_ptr, head_offset, scale_log2, stride_c_block, stride_c_kv,
                    stride_c_slot, stride_c_dim, BLOCK_SIZE, BLOCK_N, DOT_FP32,
                )  # fmt: skip

        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        acc = acc / l_i[:, None]
        o_offsets = (q_start + token).to(tl.int64)[:, None] * stride_o_tok
        o_offsets += head[:, None] * stride_o_head + dims[None, :] * stride_o_dim
        tl.store(out_ptr + o_offsets, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(
    query: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Same contract as ``kernels.dispatch.paged_attention``; one kernel launch.

    Rows past ``sum(query_lens)`` (padding) are zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = layer_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit cache {tuple(layer_cache.shape)}"
        )
    group = num_heads // num_kv_heads
    num_seqs = meta.block_tables.shape[0]
    if num_seqs == 0 or meta.max_query_len == 0:
        return torch.zeros_like(query)
    # The kernel writes every row of every query token; only padding rows past them need
    # zeroing (a memset launch per layer saved when there are none, e.g. every model step).
    out = torch.empty_like(query)
    num_query_tokens = meta.num_query_tokens
    if num_query_tokens < num_tokens:
        out[num_query_tokens:].zero_()

    # Decode-only steps need one token per tile; prefills use taller tiles.
    block_m = 16 if meta.max_query_len == 1 else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    tokens_per_tile = max(1, min(block_m // group, meta.max_query_len))
    block_n = 64 if block_m <= 16 else 32
    grid = (num_seqs, num_kv_heads, triton.cdiv(meta.max_query_len, tokens_per_tile))
    _paged_attention_kernel[grid](
        out,
        query,
        layer_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * _LOG2E,
        *query.stride(),
        *out.stride(),
        *layer_cache.stride(),
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP=group,
        TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # fp32 caches get exact (non-TF32) dots. Off CUDA we run in the Triton interpreter,
        # whose tl.dot mis-reads bfloat16 operands, so it always computes in fp32 there.
        DOT_FP32=layer_cache.dtype == torch.float32 or not layer_cache.is_cuda,
        INTERPRETED=not layer_cache.is_cuda,
    )
    return out
