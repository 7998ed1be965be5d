"""Paged-attention kernels: Triton on CUDA, a vectorised torch reference on CPU.

Also the fused layer ops (RMSNorm, add+RMSNorm, rope+KV write, SiLU-and-mul) and the prefill
split (``prefill_attention.py``). May import torch and triton only: never ``scheduler``,
``kvtransfer``, ``workers`` or ``cluster``.
"""

from tandem.kernels.dispatch import paged_attention, write_kv_cache
from tandem.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]
