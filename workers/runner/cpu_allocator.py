"""glibc malloc tuning for CPU inference.

A prefill step allocates and frees tens of large activations (a 2048-token step of a
512-wide model: ~400 MB). glibc serves blocks above its mmap threshold with fresh
``mmap`` pages and unmaps them on free, so every step pays a page fault and a page clear
per 4 KiB touched again (~100k faults, about a quarter of the step's time). Raising the
mmap threshold to its maximum (32 MiB on 64-bit) and the trim threshold keeps freed memory
in the heap for the next step; the price is that the process keeps its peak heap.

Process-wide and idempotent; a no-op where glibc is absent (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30

_tuned: bool | None = None


def tune_malloc_for_inference() -> bool:
    """Apply the thresholds above once per process; True when glibc accepted them."""
    global _tuned
    if _tuned is None:
        _tuned = _apply()
    return _tuned


def _apply() -> bool:
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
