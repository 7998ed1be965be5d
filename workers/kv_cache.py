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

import torch

from kvtransfer.compat import BLOCKS_FIRST, KV_LAYOUTS, STORAGE_ORDER

DEFAULT_CPU_KV_BYTES = 1 << 30


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def num_blocks_for(
    *,
    block_bytes: int,
    num_kv_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    device: torch.device,
) -> int:
    """Explicit count wins; otherwise memory bytes (CPU: ``kv_cache_memory``,
    default 1 GiB; CUDA: what ``gpu_memory_utilization`` leaves after the
    weights already on the device)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * gpu_memory_utilization) - used
    else:
        budget = DEFAULT_CPU_KV_BYTES
    n = budget // block_bytes
    if n < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes; "
            "raise --kv-cache-memory / --gpu-memory-utilization or set --num-kv-blocks"
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
    storage = torch.zeros([logical[i] for i in order], dtype=dtype, device=device)
    return storage.permute(*[order.index(i) for i in range(6)])
