"""KV cache allocation: one tensor per worker, in one of two byte layouts.

Every user of the cache (attention, dense decode, block copies) sees the same
logical tensor ``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]``; layer ``l`` is the strided view ``kv_cache[:, l]`` and the kernels
take any strides. What differs is where the bytes lie (``kvtransfer/compat.py``)::

    blocks_first  storage [blk, L, 2, bs, H, d]  (the logical order: contiguous)
    head_major    storage [blk, H, L, 2, bs, d]  (a permuted view of it)

In both, one block of every layer is one contiguous region, so a whole-block
transfer is one descriptor per run of blocks. Head-major also makes one KV
head (or a range of heads) of a block one contiguous piece: a decode engine
with another tensor-parallel size reads its heads' slice of a block as one
descriptor instead of ``L*2*bs`` (``kvtransfer/tp_plan.py``).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from typing import Any

import torch

from tandem.kvtransfer.compat import BLOCKS_FIRST, KV_LAYOUTS, STORAGE_ORDER
from tandem.workers.runner.device_memory import outside_torch_bytes

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30

# Most blocks a memory budget is turned into (``--num-kv-blocks`` sets any count). Some state
# is per block: the scheduler's KVBlock and free-list state (~0.7 s and ~170 MB of Python per
# million on the dev box), the NIXL block lists prepared for this engine and for each peer at
# its handshake (~90 ms per 131k blocks on CPU), and check_integrity walks every block. A tiny
# model at 0.9 of an 80 GB GPU would get millions of blocks (a 2-layer fp32 test llama: ~9M);
# real ones stay far below the cap (Llama-3.2-1B bf16: ~137k, Qwen2.5-0.5B bf16: ~370k).
# 2**20 blocks of 16 tokens is 16M tokens of context: more than max_num_seqs x max_model_len
# of any configuration served here, with room for the prefix cache. It also keeps every slot
# id below 2**31 for block sizes up to 1024 (the decode graphs' int32 slot buffer).
MAX_AUTO_KV_BLOCKS = 1 << 20


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def gpu_kv_budget_bytes(
    *,
    total_bytes: int,
    free_bytes: int,
    own_bytes: int,
    gpu_memory_utilization: float,
    step_bytes: int = 0,
) -> int:
    """Bytes this engine may give its KV cache on a GPU it may share.

    The engine owns ``gpu_memory_utilization`` of the device's memory, and
    what it already holds there (``own_bytes``: its torch allocator's
    reservation, i.e. weights, and what the process holds outside torch, its
    CUDA context and libraries) comes out of that share, not what other
    processes hold: two engines of 0.45 on one GPU each get 0.45 of it,
    whichever starts second. So does what it will hold besides the cache
    (``step_bytes``: the activation peak and the CUDA graphs, measured by
    ``workers.graphs.memory.profile_step_memory``)::

        |<------------------------------- total ------------------------------->|
        | A: weights + steps + KV = 0.45 | B: weights + steps + KV = 0.45 | free |

    (Subtracting the device-wide used memory instead, the second engine
    would count the first one's share against its own.) The cache and the
    step bytes must also fit in what is free now; if they do not, other
    processes hold more than the rest of the GPU: ValueError naming the flag.
    """
    budget = int(total_bytes * gpu_memory_utilization) - own_bytes - step_bytes
    if budget + step_bytes > free_bytes:
        gib = 2**30
        raise ValueError(
            f"--gpu-memory-utilization {gpu_memory_utilization} leaves this engine "
            f"{budget / gib:.2f} GiB for its KV cache (and {step_bytes / gib:.2f} GiB for "
            f"activations and CUDA graphs) but only {free_bytes / gib:.2f} GiB of "
            f"{total_bytes / gib:.2f} GiB are free: other processes on this GPU hold more than "
            "the rest of it; lower the utilization of the engines sharing it "
            "(--prefill-gpu-memory-utilization, --decode-gpu-memory-utilization)"
        )
    return budget


def num_blocks_for(
    *,
    block_bytes: int,
    num_kv_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    device: torch.device,
    mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None,
    memory_reserved: Callable[[torch.device], int] | None = None,
    step_bytes: int = 0,
    outside_torch: Callable[[torch.device], int] | None = None,
) -> int:
    """Explicit count wins; otherwise memory bytes (CPU: ``kv_cache_memory``,
    default 1 GiB; CUDA: ``gpu_kv_budget_bytes``, after the weights are
    loaded, less ``step_bytes`` for activations and graphs), at most
    ``MAX_AUTO_KV_BLOCKS`` blocks. On CUDA the engine's own bytes are torch's
    reservation plus what the process holds outside it (its CUDA context, the
    libraries' modules: ``workers.runner.device_memory``, NVML). ``mem_get_info``
    / ``memory_reserved`` / ``outside_torch`` default to torch.cuda's and NVML's
    (tests pass fakes)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device.type == "cuda":
        free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
        weights = (memory_reserved or torch.cuda.memory_reserved)(device)
        context = (outside_torch or outside_torch_bytes)(device)
        budget = gpu_kv_budget_bytes(
            total_bytes=total,
            free_bytes=free,
            own_bytes=weights + context,
            gpu_memory_utilization=gpu_memory_utilization,
            step_bytes=step_bytes,
        )
        gib = 2**30
        logger.info(
            "KV cache budget %.2f GiB = %.2f x %.2f GiB - weights %.2f GiB - outside torch "
            "(CUDA context, libraries) %.2f GiB - activations and CUDA graphs %.2f GiB",
            budget / gib,
            gpu_memory_utilization,
            total / gib,
            weights / gib,
            context / gib,
            step_bytes / gib,
        )
    else:
        budget = DEFAULT_CPU_KV_BYTES
    n = budget // block_bytes
    if n > MAX_AUTO_KV_BLOCKS:
        logger.info(
            "KV cache: the budget holds %d blocks, capped at %d (MAX_AUTO_KV_BLOCKS; "
            "--num-kv-blocks sets any count)",
            n,
            MAX_AUTO_KV_BLOCKS,
        )
        return MAX_AUTO_KV_BLOCKS
    if n < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes"
            + (f" (after {step_bytes} bytes of activations and CUDA graphs)" if step_bytes else "")
            + "; raise --kv-cache-memory / --gpu-memory-utilization or set --num-kv-blocks"
        )
    return int(n)


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    layout: str = BLOCKS_FIRST,
) -> torch.Tensor:
    """Zeroed cache (the reference kernels need finite values everywhere),
    returned as the logical ``[blk, L, 2, bs, H, d]`` tensor of ``layout``."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {layout!r}")
    logical = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    order = STORAGE_ORDER[layout]
    shape = [logical[i] for i in order]
    if torch.device(device).type == "cpu":
        storage = page_aligned_zeros(shape, dtype)
    else:
        storage = torch.zeros(shape, dtype=dtype, device=device)
    return storage.permute(*[order.index(i) for i in range(6)])


def page_aligned_zeros(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose bytes start on a page (an anonymous mapping; torch's
    own allocator aligns to 64 bytes). The disk KV tier reads cold blocks with
    ``O_DIRECT`` straight into them, which needs that alignment
    (kvtransfer/tiers/segment_reads.py); the storage starts at the tensor's first byte."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # private anonymous memory: zero-filled, page-aligned, pages touched on first use;
    # huge pages where the kernel allows them, as numpy asks for its large arrays (a
    # read with O_DIRECT pins every page it lands in: 4 KiB pages made those reads
    # half as fast on the CPU box)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def allocate_model_kv_cache(
    config: Any, model: torch.nn.Module, num_blocks: int, device: torch.device | str
) -> torch.Tensor:
    """``allocate_kv_cache`` for ``model`` (its layers, KV heads, head size and dtype) with
    ``config``'s ``block_size`` and ``kv_layout``."""
    return allocate_kv_cache(
        num_blocks,
        model.num_layers,
        config.cache.block_size,
        model.num_kv_heads,
        model.head_dim,
        next(model.parameters()).dtype,
        torch.device(device),
        layout=config.cache.kv_layout,
    )
