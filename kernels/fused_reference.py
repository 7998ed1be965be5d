"""Torch reference of the fused layer ops: the CPU path, and the oracle for the Triton kernels.

These are the model's own CPU code paths, moved here unchanged so that CPU output stays
token-exact with transformers (same ops, same roundings) and CUDA can swap in one Triton launch
per op (``kernels.dispatch``):

    rms_norm(x, w)                 ->  w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)
    add_rms_norm(x, residual, w)   ->  (rms_norm(x + residual), x + residual)
    rope_write_kv(qk, v, cos, sin) ->  rotate q and k heads, write k (rotated) and v to the cache
    silu_and_mul(gate_up)          ->  silu(gate) * up
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32 like transformers' ``LlamaRMSNorm``.

    ``x`` ``[..., N]`` (any strides), ``weight`` ``[N]``; returns a new tensor in the dtype of
    ``weight * x`` (the model dtype).
    """
    if x.dtype == torch.float32:  # one fused op, bit-identical in fp32
        return F.rms_norm(x, weight.shape, weight, eps)
    input_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual stream and its norm.

    ``x`` and ``residual`` ``[T, N]`` of one dtype; the sum is rounded to that dtype before the
    norm reads it, as transformers does (``hidden = residual + hidden``).
    """
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of ``qk`` ``[T, H, D]`` (rotate-half layout); returns a new tensor.

    ``cos``/``sin`` ``[T, 1, D / 2]`` in ``qk``'s dtype. Same roundings as HF's
    ``x * cos + rotate_half(x) * sin`` with the tables duplicated over both halves.
    """
    x1, x2 = qk.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_write_kv(
    qk: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k, write the rotated k and ``value`` to the cache; return rotated ``qk``.

    ``qk`` ``[T, Hq + Hkv, D]``: query heads then key heads (any strides); ``value``
    ``[T, Hkv, D]``; cache and ``slot_mapping`` as in ``kernels.dispatch.write_kv_cache``.
    """
    rotated = rope(qk, cos, sin)
    num_kv_heads = value.shape[1]
    reference.write_kv_cache(rotated[:, -num_kv_heads:], value, layer_cache, slot_mapping)
    return rotated


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2 I]`` (gate columns first).

    Works in place on ``gate_up``'s gate half (a fresh matmul output in the model): two fewer
    ``[T, I]`` temporaries, same values. The caller must not reuse ``gate_up``.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)
