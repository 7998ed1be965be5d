"""How a piece of a segment (consecutive blocks of one file) is read into device blocks.

    1. the leading blocks the page cache holds (a segment written or read lately;
       asked with ``mincore``) by a buffered ``preadv`` straight into the device
       blocks: one copy, no I/O
    2. the rest with ONE ``O_DIRECT`` read into this thread's page-aligned staging
       buffer (the device's DMA lands there; no page cache pages are allocated,
       filled and indexed on the way), then each block copied into its device block
       and its xxh3 taken on the copy, still in the core's cache

Why not a plain buffered read of the rest: on the 2-core box a cold 16 MiB buffered
``preadv`` ran at about 0.8-0.9 of a sequential read's speed, the kernel's work of
filling the page cache adding to the copy, while the ``O_DIRECT`` read plus the copy
ran at 1.1-1.2 (docs/benchmarks.md, #25 session 11). Why through a staging buffer and
not straight into the device blocks: ``O_DIRECT`` needs the destination aligned to the
disk's logical block, and the KV cache torch allocates is aligned to 64 bytes only; a
destination that happens to be page-aligned is read into directly. Where the file
system refuses ``O_DIRECT`` (tmpfs: EINVAL) the tier falls back to a buffered read.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Any

import numpy as np

from tandem.kvtransfer.tiers import segments as seg_files
from tandem.kvtransfer.tiers.segments import PAGE, Segment

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _first_missing(fd: int, offset: int, length: int) -> int:
    """The first page of ``fd``'s range that the page cache does not hold (0 when the
    kernel will not say; the range's page count when it holds them all)."""
    pages = -(-length // PAGE)
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        return 0
    try:
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(addr, length, vec) != 0:
            return 0
    finally:
        _libc.munmap(addr, length)
    held = np.frombuffer(vec, dtype=np.uint8) & 1
    return pages if held.all() else int(held.argmin())


STAGING_BYTES = 16 << 20  # per reader thread: the most one O_DIRECT read stages


class SegmentReader:
    def __init__(self, block_bytes: int, aligned_row: Any, copy_bytes: Any, checksum: Any) -> None:
        self.block_bytes = block_bytes
        self.stride = seg_files.stride(block_bytes)
        self.max_blocks = max(1, STAGING_BYTES // self.stride)  # one staged read
        self.direct = True  # False once the file system refused O_DIRECT
        self._aligned_row = aligned_row
        self._copy = copy_bytes
        self._checksum = checksum
        self._local = threading.local()

    def read(self, path: str, seg: Segment, first: int, outs: list[np.ndarray]) -> list[bool]:
        """Fill ``outs`` with ``len(outs)`` blocks of ``seg`` from slot ``first``; per
        block, whether its xxh3 matches the segment's (taken right after the block
        landed). OSError, or ValueError for a file cut short."""
        offset = seg.offset(first, self.block_bytes)
        checks = seg.checks[first : first + len(outs)]
        done = self._cached(path, offset, outs)
        ok = [self._checksum(out) == c for out, c in zip(outs[:done], checks, strict=False)]
        at = done
        while at < len(outs):  # normally once: plan() keeps pieces within the staging
            part = outs[at : at + self.max_blocks]
            sums = self._direct(path, offset + at * self.stride, part)
            if sums is None:  # no O_DIRECT here: a buffered read
                pads = self._pads(part)
                seg_files.read_run(path, offset + at * self.stride, part, self.block_bytes, pads)
                sums = [self._checksum(out) for out in part]
            ok += [got == want for got, want in zip(sums, checks[at:], strict=False)]
            at += len(part)
        return ok

    def _pads(self, outs: list[np.ndarray]) -> list[memoryview]:
        gap = self.stride - self.block_bytes
        if not gap:
            return []
        pad = getattr(self._local, "pad", None)
        if pad is None or len(pad) != gap:
            pad = self._local.pad = memoryview(bytearray(gap))
        return [pad] * (len(outs) - 1)

    def _cached(self, path: str, offset: int, outs: list[np.ndarray]) -> int:
        """How many of the leading blocks the page cache holds (``mincore``, which
        starts no I/O: a buffered read, even ``RWF_NOWAIT``, would start the kernel's
        read-ahead of the rest, a second read of what O_DIRECT then reads), read
        straight into their device blocks with a buffered ``preadv``."""
        if not self.direct:
            return 0  # everything is read buffered anyway
        fd = os.open(path, os.O_RDONLY)
        try:
            missing = _first_missing(fd, offset, len(outs) * self.stride)
        finally:
            os.close(fd)
        # block i is whole when its last page comes before the first page missing
        done = 0
        while done < len(outs) and done * self.stride + self.block_bytes <= missing * PAGE:
            done += 1
        if done:
            part = outs[:done]
            seg_files.read_run(path, offset, part, self.block_bytes, self._pads(part))
        return done

    def _direct(self, path: str, offset: int, outs: list[np.ndarray]) -> list[int] | None:
        """One O_DIRECT read of ``outs``' blocks (whole strides), then each block's
        xxh3; None when the file system refuses O_DIRECT (the caller reads buffered)."""
        if not self.direct:
            return None
        size = len(outs) * self.stride
        straight = not self.stride - self.block_bytes and all(
            o.ctypes.data % PAGE == 0 for o in outs
        )
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # no O_DIRECT on this file system
                self.direct = False
                return None
            raise
        try:
            if straight:
                n = os.preadv(fd, [memoryview(o) for o in outs], offset)
            else:
                staging = self._staging()[:size]
                n = os.preadv(fd, [memoryview(staging)], offset)
        finally:
            os.close(fd)
        if n != size:
            raise ValueError("segment file cut short")
        if straight:
            return [self._checksum(out) for out in outs]
        sums = []
        for i, out in enumerate(outs):  # copy, then the checksum of the copy (cached)
            self._copy(out, staging[i * self.stride : i * self.stride + self.block_bytes])
            sums.append(self._checksum(out))
        return sums

    def _staging(self) -> np.ndarray:
        row = getattr(self._local, "staging", None)
        if row is None:
            row = self._local.staging = self._aligned_row(self.max_blocks * self.stride)
        return row
