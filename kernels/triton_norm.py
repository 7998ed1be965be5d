"""Triton RMSNorm, alone or fused with the residual add: one program per row, one launch.

Numerics follow ``kernels.fused_reference``: the sum of squares in float32, the normalised row
rounded to the input dtype before the weight multiplies it (transformers' order), the residual
sum rounded to its dtype before the norm reads it. Rows may be strided (q/k heads of a fused
QKV output): ``x`` is seen as ``[outer, inner, N]`` with any strides on the first two dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    eps,
    num_inner,
    stride_x_outer,
    stride_x_inner,
    stride_r_row,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x_offset = (row // num_inner) * stride_x_outer + (row % num_inner) * stride_x_inner
    x = tl.load(x_ptr + x_offset + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # rounded like torch's add
        tl.store(sum_ptr + row * N + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / N
    normed = x32 * (1.0 / tl.sqrt(mean_square + eps))
    if ROUND_NORMED:
        normed = normed.to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("rms_norm needs unit stride on the normalised dim")
    if x.dim() == 2:
        x3 = x.unsqueeze(1)
    elif x.dim() == 3:
        x3 = x
    else:
        x3 = x.reshape(-1, 1, n)
    num_rows = x3.shape[0] * x3.shape[1]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or x.dim() != 2:
            raise ValueError("add_rms_norm needs x and residual of one 2-D shape and dtype")
        if residual.stride(-1) != 1:
            raise ValueError("add_rms_norm needs unit stride on the residual's last dim")
        summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, summed
    _rms_norm_kernel[(num_rows,)](
        x3,
        residual if residual is not None else x3,
        weight,
        out,
        summed if summed is not None else out,
        eps,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        residual.stride(0) if residual is not None else 0,
        N=n,
        BLOCK_N=triton.next_power_of_2(n),
        ADD_RESIDUAL=residual is not None,
        ROUND_NORMED=x.dtype != torch.float32,
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``kernels.fused_reference.rms_norm`` (2-D or 3-D ``x``)."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.fused_reference.add_rms_norm``; one launch for both."""
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed
