"""The Triton kernel of ``gather.py`` (imported only when a gather runs: Triton stays out
of the CPU tier's imports)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, words, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    src_row = tl.load(src_rows_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_rows_ptr + i).to(tl.int64)
    offsets = c * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < words
    values = tl.load(src_ptr + src_row * words + offsets, mask=mask)
    tl.store(dst_ptr + dst_row * words + offsets, values, mask=mask)
