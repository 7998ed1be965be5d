"""Kernel dispatch: Triton for CUDA tensors, the torch reference on CPU.

``TANDEM_FORCE_TRITON=1`` routes CPU tensors to the Triton kernels too, so tests can run them
under ``TRITON_INTERPRET=1``. Triton is imported lazily: the CPU path never loads it.
"""

from __future__ import annotations

import os

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata


def _use_triton(tensor: torch.Tensor) -> bool:
    # Read per call (cheap) so a test can set the variable after ``kernels`` was imported.
    return tensor.is_cuda or os.environ.get("TANDEM_FORCE_TRITON") == "1"


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[num_tokens, Hkv, D]`` into ``layer_cache`` slots, in place.

    ``layer_cache``: ``[num_blocks, 2, block_size, Hkv, D]``, any strides (index 0 = K, 1 = V).
    ``slot_mapping[t] = block * block_size + offset``; -1 skips token ``t``.
    """
    if _use_triton(key):
        from kernels import triton_cache

        triton_cache.write_kv_cache(key, value, layer_cache, slot_mapping)
    else:
        reference.write_kv_cache(key, value, layer_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal paged attention for a mixed batch (prefills, chunks, decodes) in one call.

    ``query``: ``[num_tokens, Hq, D]`` with ``Hq % Hkv == 0``. Token ``j`` of sequence ``i`` sits
    at position ``seq_len_i - query_len_i + j`` and attends to keys ``0..position`` of that
    sequence, which must already be in the cache. Returns ``[num_tokens, Hq, D]`` in
    ``query``'s dtype.
    """
    if _use_triton(query):
        from kernels import triton_attention

        return triton_attention.paged_attention(query, layer_cache, meta, scale)
    return reference.paged_attention(query, layer_cache, meta, scale)
