"""Triton rope fused with the KV-cache write: one program per token, one launch per layer.

Replaces, on CUDA, the rope ops on q and k (two multiplies, two adds, a concat per half) plus
the separate KV-write kernel. Per token ``t``::

    qk[t]  [Hq + Hkv, D]  --rotate-->  out[t]          (q heads, then the k heads)
                                       cache[slot(t), K] <- out[t, Hq:]
    v[t]   [Hkv, D]       ------------> cache[slot(t), V]     (slot -1: no write)

The rotation computes in float32 and rounds once to the output dtype (the torch reference
rounds each product: results may differ by one unit in the last place outside fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_write_kv_kernel(
    qk_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_qk_tok,
    stride_qk_head,
    stride_v_tok,
    stride_v_head,
    stride_cos_tok,
    stride_sin_tok,
    stride_c_block,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dim_valid = dims < HALF_DIM
    total_heads = NUM_HEADS + NUM_KV_HEADS
    mask = (heads[:, None] < total_heads) & dim_valid[None, :]

    cos = tl.load(cos_ptr + token * stride_cos_tok + dims, mask=dim_valid, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin_tok + dims, mask=dim_valid, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    x_ptrs = qk_ptr + token * stride_qk_tok + heads[:, None] * stride_qk_head + dims[None, :]
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty)
    out_offsets = token * total_heads * 2 * HALF_DIM + heads[:, None] * 2 * HALF_DIM + dims[None, :]
    tl.store(out_ptr + out_offsets, o1, mask=mask)
    tl.store(out_ptr + out_offsets + HALF_DIM, o2, mask=mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        base = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
        # key heads are rows NUM_HEADS.. of the tile: cache head index = row - NUM_HEADS
        is_key = (heads[:, None] >= NUM_HEADS) & mask
        k_offsets = base + (heads[:, None] - NUM_HEADS) * stride_c_head + dims[None, :]
        k_offsets = tl.where(is_key, k_offsets, 0)
        elem = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + k_offsets, o1.to(elem), mask=is_key)
        tl.store(cache_ptr + k_offsets + HALF_DIM, o2.to(elem), mask=is_key)

        kv_heads = tl.arange(0, BLOCK_KV)
        full_dims = tl.arange(0, 2 * BLOCK_HALF)
        v_mask = (kv_heads[:, None] < NUM_KV_HEADS) & (full_dims[None, :] < 2 * HALF_DIM)
        v = tl.load(
            v_ptr + token * stride_v_tok + kv_heads[:, None] * stride_v_head + full_dims[None, :],
            mask=v_mask,
        )
        v_offsets = base + stride_c_kv + kv_heads[:, None] * stride_c_head + full_dims[None, :]
        tl.store(cache_ptr + v_offsets, v.to(elem), mask=v_mask)


def rope_write_kv(
    qk: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``kernels.fused_reference.rope_write_kv``; one kernel launch."""
    num_tokens, total_heads, head_dim = qk.shape
    num_kv_heads = value.shape[1]
    if head_dim % 2 or value.shape[2] != head_dim or layer_cache.shape[-1] != head_dim:
        raise ValueError(
            f"rope_write_kv: qk {tuple(qk.shape)}, value {tuple(value.shape)} and cache "
            f"{tuple(layer_cache.shape)} need one even head_dim"
        )
    for name, t in (("qk", qk), ("value", value), ("layer_cache", layer_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_write_kv: {name} needs unit stride on head_dim")
    out = torch.empty(num_tokens, total_heads, head_dim, dtype=qk.dtype, device=qk.device)
    if num_tokens == 0:
        return out
    cos2 = cos.reshape(cos.shape[0], -1)
    sin2 = sin.reshape(sin.shape[0], -1)
    _rope_write_kv_kernel[(num_tokens,)](
        qk,
        value,
        cos2,
        sin2,
        out,
        layer_cache,
        slot_mapping,
        qk.stride(0),
        qk.stride(1),
        value.stride(0),
        value.stride(1),
        cos2.stride(0),
        sin2.stride(0),
        layer_cache.stride(0),
        layer_cache.stride(1),
        layer_cache.stride(2),
        layer_cache.stride(3),
        NUM_HEADS=total_heads - num_kv_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF_DIM=head_dim // 2,
        BLOCK_SIZE=layer_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(total_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
    )
    return out
