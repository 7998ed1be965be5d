"""Triton KV-cache write: one program per token copies its K and V heads into its slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_c_block,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    stride_c_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        k = tl.load(
            key_ptr
            + token * stride_k_tok
            + heads[:, None] * stride_k_head
            + dims[None, :] * stride_k_dim,
            mask=mask,
        )
        v = tl.load(
            value_ptr
            + token * stride_v_tok
            + heads[:, None] * stride_v_head
            + dims[None, :] * stride_v_dim,
            mask=mask,
        )
        base = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
        offsets = base + heads[:, None] * stride_c_head + dims[None, :] * stride_c_dim
        tl.store(cache_ptr + offsets, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + stride_c_kv + offsets, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``kernels.dispatch.write_kv_cache``; one kernel launch."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        layer_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *layer_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=layer_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
