"""Paged-attention kernels: Triton on CUDA, a vectorised torch reference on CPU."""

from kernels.dispatch import paged_attention, write_kv_cache
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]
