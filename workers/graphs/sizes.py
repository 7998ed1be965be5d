"""Which decode batch sizes get a CUDA graph, and the ``--cuda-graph-sizes`` flag.

Default buckets, as vLLM's: 1, 2, 4, 8, 16, then every 16 up to ``max_num_seqs``, plus
``max_num_seqs`` itself so every decode batch the scheduler can form has a graph::

    max_num_seqs 40  ->  1 2 4 8 16 32 40
    a batch of 19 decodes replays the 32 graph (13 padding rows)

Pure Python (no torch): ``EngineConfig`` validates the flag with it.
"""

from __future__ import annotations

import bisect


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """Sorted, distinct batch sizes to capture; ``sizes`` None gives the default buckets.

    Raises ``ValueError`` naming ``cuda_graph_sizes`` for an entry < 1 or > ``max_num_seqs``
    (such a graph could never be replayed) or for an empty list.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if sizes is None:
        default = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
        default += list(range(16, max_num_seqs + 1, 16))
        return sorted(set(default) | {max_num_seqs})
    if not sizes:
        raise ValueError("cuda_graph_sizes must name at least one batch size")
    for size in sizes:
        if not 1 <= size <= max_num_seqs:
            raise ValueError(
                f"cuda_graph_sizes entry {size} must be in [1, max_num_seqs={max_num_seqs}]"
            )
    return sorted(set(sizes))


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """Smallest captured size >= ``num_seqs`` (sorted ``sizes``); None: run eager."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) and num_seqs >= 1 else None


def parse_cuda_graph_sizes(text: str) -> list[int]:
    """``"1,2,4,8"`` (commas and/or spaces) -> ``[1, 2, 4, 8]``; the flag's argparse type."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"cuda_graph_sizes: {text!r} is not a list of integers (e.g. 1,2,4,8)"
        ) from None
    if not sizes:
        raise ValueError("cuda_graph_sizes must name at least one batch size")
    return sizes
