"""The models' attention entry point: paged kernels, plus the CPU dense-decode fast path.

A step's metadata is either a plain ``kernels.AttentionMetadata`` (every token through the
paged kernels) or a ``SplitAttention`` built by the model runner, whose tokens come in two
runs::

    tokens   | decodes in dense rows (num_dense) | everything else (paged)          |
    K/V      written to the paged cache for ALL tokens (it stays the source of truth)
    attend   DenseDecodeStep.attend              paged_attention(meta=paged)

Paged metadata with ``sdpa_prefills`` set sends its prefix-free prefills through SDPA on the
fresh K/V instead (``kernels.prefill_attention``); decodes, chunks and prefix hits stay paged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import AttentionMetadata, write_kv_cache
from tandem.kernels.prefill_attention import attend as paged_or_sdpa
from tandem.workers.runner.dense_decode import DenseDecodeStep


@dataclass
class SplitAttention:
    """Step metadata when some decodes take the dense path (see module docstring)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, every token of the step
    dense: DenseDecodeStep  # the first dense.num_tokens tokens
    paged: AttentionMetadata | None  # the remaining tokens, None when there are none


StepMetadata = AttentionMetadata | SplitAttention


def attention(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: StepMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's ``k``/``v`` ``[T, Hkv, D]`` to layer ``layer_idx`` of ``kv_cache``
    and return causal attention of ``q`` ``[T, Hq, D]`` as ``[T, Hq, D]``."""
    write_kv_cache(k, v, kv_cache[:, layer_idx], meta.slot_mapping)
    return attend(layer_idx, q, k, v, kv_cache, meta, scale)


def attend(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: StepMetadata,
    scale: float,
) -> torch.Tensor:
    """Like ``attention`` for a cache that already holds this step's ``k``/``v`` (the models
    write them with ``kernels.dispatch.rope_write_kv``); ``k``/``v`` feed the dense rows."""
    layer_cache = kv_cache[:, layer_idx]
    if isinstance(meta, AttentionMetadata):
        return paged_or_sdpa(q, k, v, layer_cache, meta, scale)
    n = meta.dense.num_tokens
    out = meta.dense.attend(layer_idx, q[:n], k[:n], v[:n], layer_cache, scale)
    if meta.paged is None:
        return out
    rest = paged_or_sdpa(q[n:], k[n:], v[n:], layer_cache, meta.paged, scale)
    return torch.cat((out, rest))
