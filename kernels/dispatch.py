"""Kernel dispatch: Triton for CUDA tensors, the torch reference on CPU.

Attention (``paged_attention``, ``write_kv_cache``) and the fused layer ops (``rms_norm``,
``add_rms_norm``, ``rope_write_kv``, ``silu_and_mul``) each take one path per call: the
references are the CPU fast paths (``kernels.reference``, ``kernels.fused_reference``), the
Triton kernels replace several small launches with one on CUDA.

``TANDEM_FORCE_TRITON=1`` routes CPU tensors to the Triton kernels too, so tests can run them
under ``TRITON_INTERPRET=1``. Triton is imported lazily: the CPU path never loads it. While
``torch.compile`` traces the model (``workers/compile/``) every op takes the reference.
"""

from __future__ import annotations

import os

import torch

from tandem.kernels import fused_reference, reference
from tandem.kernels.metadata import AttentionMetadata


def _use_triton(tensor: torch.Tensor) -> bool:
    # Read per call (cheap) so a test can set the variable after ``kernels`` was imported.
    # Under torch.compile the references are traced and the compiler fuses them itself.
    if torch.compiler.is_compiling():
        return False
    return tensor.is_cuda or os.environ.get("TANDEM_FORCE_TRITON") == "1"


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[num_tokens, Hkv, D]`` into ``layer_cache`` slots, in place.

    ``layer_cache``: ``[num_blocks, 2, block_size, Hkv, D]``, any strides (index 0 = K, 1 = V).
    ``slot_mapping[t] = block * block_size + offset``; -1 skips token ``t``.
    """
    if _use_triton(key):
        from tandem.kernels import triton_cache

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
        from tandem.kernels import triton_attention

        return triton_attention.paged_attention(query, layer_cache, meta, scale)
    return reference.paged_attention(query, layer_cache, meta, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., N]`` over its last dim (see ``kernels.fused_reference``)."""
    if _use_triton(x):
        from tandem.kernels import triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return fused_reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` for ``[T, N]`` tensors; new tensors."""
    if _use_triton(x):
        from tandem.kernels import triton_norm

        return triton_norm.add_rms_norm(x, residual, weight, eps)
    return fused_reference.add_rms_norm(x, residual, weight, eps)


def rope_write_kv(
    qk: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``qk`` ``[T, Hq + Hkv, D]`` (query then key heads), write the rotated keys and
    ``value`` ``[T, Hkv, D]`` to ``layer_cache`` at ``slot_mapping`` (-1 skips), return the
    rotated ``qk`` as a new tensor. ``cos``/``sin``: ``[T, 1, D / 2]`` in ``qk``'s dtype."""
    if _use_triton(qk):
        from tandem.kernels import triton_rope_cache

        return triton_rope_cache.rope_write_kv(qk, value, cos, sin, layer_cache, slot_mapping)
    return fused_reference.rope_write_kv(qk, value, cos, sin, layer_cache, slot_mapping)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[T, 2 I]``; the CPU path reuses ``gate_up``'s
    memory, so the caller must not read ``gate_up`` afterwards."""
    if _use_triton(gate_up):
        from tandem.kernels import triton_activation

        return triton_activation.silu_and_mul(gate_up)
    return fused_reference.silu_and_mul(gate_up)
