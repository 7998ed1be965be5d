"""Which steps get a CUDA graph: the ``--cuda-graph-mode`` values, the decode batch sizes
(``--cuda-graph-sizes``) and the piecewise token sizes (``--piecewise-graph-sizes``).

Default buckets, as vLLM's: 1, 2, 4, 8, 16, then every 16 up to ``max_num_seqs``, plus
``max_num_seqs`` itself so every decode batch the scheduler can form has a graph::

    max_num_seqs 40  ->  1 2 4 8 16 32 40
    a batch of 19 decodes replays the 32 graph (13 padding rows)

Piecewise graphs are bucketed by the step's token count (prefills and chunks included):
1, 2, 4, 8, then every 16 up to ``min(512, max_num_batched_tokens)``, plus that cap. Larger
steps run eager: they are compute-bound, and their launches hide behind the matmuls.

Pure Python (no torch): ``EngineConfig`` validates the flags with it.
"""

from __future__ import annotations

import bisect

# --cuda-graph-mode (vLLM's names in brackets):
#   decode              full graphs for decode-only batches, other steps eager [FULL_DECODE_ONLY]
#   piecewise           every step up to the largest token size: pieces between attentions
#   full_and_piecewise  decode-only batches full, the other steps piecewise
#   none                every step eager (as --enforce-eager)
CUDA_GRAPH_MODES = ("decode", "piecewise", "full_and_piecewise", "none")
# full_and_piecewise since the H200 run of 2026-11-28 (docs/gpu.md): all of tests/gpu passed in
# it, mixed steps ran 3.5-3.8x faster than eager, decode-only steps replay the same full graphs
DEFAULT_CUDA_GRAPH_MODE = "full_and_piecewise"
MAX_DEFAULT_PIECEWISE_TOKENS = 512


# vLLM's spelling of the same mode (its names are upper case; any case is accepted)
_VLLM_ALIASES = {"full_decode_only": "decode"}


def check_cuda_graph_mode(mode: str) -> str:
    """``mode`` as one of ``CUDA_GRAPH_MODES`` (any case; vLLM's ``FULL_DECODE_ONLY`` is
    ``decode``); ValueError naming ``cuda_graph_mode`` otherwise (vLLM's ``FULL``, full graphs
    of mixed steps, is not built: attention's grid follows each step's query lengths)."""
    name = mode.lower() if isinstance(mode, str) else mode
    name = _VLLM_ALIASES.get(name, name)
    if name not in CUDA_GRAPH_MODES:
        raise ValueError(
            f"cuda_graph_mode must be one of {', '.join(CUDA_GRAPH_MODES)}, got {mode!r}"
        )
    return name


def uses_full_decode(mode: str) -> bool:
    return mode in ("decode", "full_and_piecewise")


def uses_piecewise(mode: str) -> bool:
    return mode in ("piecewise", "full_and_piecewise")


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """Sorted, distinct batch sizes to capture; ``sizes`` None gives the default buckets.

    Raises ``ValueError`` naming ``cuda_graph_sizes`` for an entry < 1 or > ``max_num_seqs``
    (such a graph could never be replayed) or for an empty list.
    """
    return _sizes("cuda_graph_sizes", "max_num_seqs", max_num_seqs, max_num_seqs, sizes)


def piecewise_sizes(max_num_batched_tokens: int, sizes: list[int] | None = None) -> list[int]:
    """Sorted, distinct step token counts to capture piecewise; ``sizes`` None: the default
    (module docstring). Raises ``ValueError`` naming ``piecewise_graph_sizes`` for an entry
    outside ``[1, max_num_batched_tokens]`` or an empty list."""
    limit = max_num_batched_tokens
    cap = min(MAX_DEFAULT_PIECEWISE_TOKENS, limit)
    return _sizes("piecewise_graph_sizes", "max_num_batched_tokens", limit, cap, sizes)


def _sizes(field: str, limit_name: str, limit: int, cap: int, sizes: list[int] | None) -> list[int]:
    """``sizes`` checked against ``[1, limit]``, or the default buckets up to ``cap``: 1, 2, 4,
    8, every 16, and ``cap`` itself."""
    if limit < 1:
        raise ValueError(f"{limit_name} must be >= 1, got {limit}")
    if sizes is None:
        default = [s for s in (1, 2, 4, 8) if s <= cap] + list(range(16, cap + 1, 16))
        return sorted(set(default) | {cap})
    if not sizes:
        raise ValueError(f"{field} must name at least one size")
    for size in sizes:
        if not 1 <= size <= limit:
            raise ValueError(f"{field} entry {size} must be in [1, {limit_name}={limit}]")
    return sorted(set(sizes))


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """Smallest captured size >= ``num_seqs`` (sorted ``sizes``); None: run eager."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) and num_seqs >= 1 else None


def parse_cuda_graph_sizes(text: str, field: str = "cuda_graph_sizes") -> list[int]:
    """``"1,2,4,8"`` (commas and/or spaces) -> ``[1, 2, 4, 8]``; the flags' argparse type.
    Errors name ``field``."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a list of integers (e.g. 1,2,4,8)") from None
    if not sizes:
        raise ValueError(f"{field} must name at least one size")
    return sizes
