"""One kernel launch for a host tier load on CUDA: the device reads the pinned host slots.

A load of N host blocks used to be N ``copy_`` calls from Python (about 20 us each, where
PCIe moves a 256 KiB block in 5: 0.20 of the link on an H200, docs/gpu.md). Here one
Triton kernel gathers them::

    program (i, c):  words [c*CHUNK, (c+1)*CHUNK) of host slot src[i]  ->  device block dst[i]

Pinned host memory is mapped into the device's address space (CUDA's unified addressing:
a page-locked allocation's host pointer is also a device pointer), so the kernel's loads
cross PCIe directly, many in flight at once, and nothing is staged. Off CUDA the same
kernel runs under ``TRITON_INTERPRET=1`` (the tests); the tier itself uses it on CUDA only.
A launch that the driver refuses (a platform without mapped pinned memory) turns the
gather off for the process, with one warning, and loads go back to one copy per block.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

CHUNK_WORDS = 2048  # 16 KiB of int64 words per program
_enabled = True
_launches = 0  # gathers queued by this process (tests)


def gather_enabled() -> bool:
    return _enabled


def gather_launches() -> int:
    return _launches


def gather_rows(
    src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor
) -> bool:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every i, rows of 2-D uint8 tensors of the
    same row size (a multiple of 8 bytes), queued on the current stream. ``src`` may be
    pinned host memory when ``dst`` is on CUDA. Returns False (nothing queued) when the
    gather is off or its launch is refused; the caller then copies row by row."""
    global _enabled, _launches
    if src.shape[1] != dst.shape[1] or src.shape[1] % 8:
        raise ValueError("rows must have the same size, a multiple of 8 bytes")
    if not _enabled or src_rows.numel() == 0:
        return _enabled
    import triton

    from tandem.kvtransfer.tiers._gather_kernel import gather_rows_kernel

    words = src.shape[1] // 8
    grid = (src_rows.numel(), triton.cdiv(words, CHUNK_WORDS))
    try:
        gather_rows_kernel[grid](
            src.view(torch.int64), dst.view(torch.int64), src_rows, dst_rows, words,
            CHUNK=CHUNK_WORDS,
        )  # fmt: skip
    except (RuntimeError, ValueError) as exc:  # e.g. "cannot be accessed from Triton"
        _enabled = False
        logger.warning("KV tier: the device cannot read pinned host memory (%s); host "
                       "loads copy block by block", exc)  # fmt: skip
        return False
    _launches += 1
    return True


def warm_up(src: torch.Tensor, device: torch.device, stream: torch.cuda.Stream) -> None:
    """Compile the kernel (and find out whether the device reads ``src``'s pinned memory)
    at start-up, on ``stream``, rather than in the first load: one row into a scratch row."""
    scratch = torch.empty(1, src.shape[1], dtype=torch.uint8, device=device)
    with torch.cuda.stream(stream):
        index = torch.zeros(1, dtype=torch.int64, device=device)
        gather_rows(src[:1], scratch, index, index)
    stream.synchronize()
