"""Triton SiLU-and-multiply: ``silu(gate) * up`` from the fused gate/up matmul, one launch.

Numerics follow the torch reference: silu in float32 rounded to the input dtype, then the
product rounded once more (torch's ``silu(gate).mul_(up)`` in half precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in_row,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * stride_in_row + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in_row + INTERMEDIATE + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    out = (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * INTERMEDIATE + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as ``kernels.fused_reference.silu_and_mul`` (``gate_up`` is not changed)."""
    num_rows, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"silu_and_mul needs [T, 2 I] with unit column stride, got {gate_up.shape}"
        )
    intermediate = width // 2
    out = torch.empty(num_rows, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(intermediate))
    grid = (num_rows, triton.cdiv(intermediate, block))
    _silu_and_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), INTERMEDIATE=intermediate, BLOCK=block
    )
    return out
