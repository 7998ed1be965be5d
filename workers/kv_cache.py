"""KV cache allocation: one tensor, blocks first.

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
             ^ one block of every layer (K and V) is one contiguous region,
               so a request's transfer is one descriptor per run of blocks.

Layer ``l`` sees the strided view ``kv_cache[:, l]``.
"""

from __future__ import annotations

import torch

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
) -> torch.Tensor:
    return torch.zeros(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )
