"""Load one tensor-parallel rank's weights straight from the checkpoint's slices.

Each rank opens the safetensors files itself and reads only its rows or
columns of a sharded weight (``safe_open(...).get_slice(name)[a:b]`` reads
that byte range of the memory map), so no rank ever holds a full copy of a
sharded tensor; replicated ones (norms, q/k-norm) are read whole. The rules
(see ``workers/parallel/plan.py`` for the split)::

    q_proj.{weight,bias}            rows of this rank's query heads
    k_proj / v_proj.{weight,bias}   rows of this rank's KV heads (replicated ranks read the same)
    gate_proj / up_proj             rows [r*I/N, (r+1)*I/N)
    o_proj.weight / down_proj.weight  the matching input columns
    o_proj.bias / down_proj.bias    rank 0: whole; other ranks: zeros (added once)
    embed_tokens / lm_head.weight   vocab rows, the last rank's padded with zeros

GGUF checkpoints are converted once into a cached safetensors directory
(``workers/checkpoints/gguf_convert.py``, done by the engine core before the
workers start), and every rank slices that directory like any other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.workers.parallel.group import TPGroup
from tandem.workers.parallel.plan import TPPlan, rank_config


@dataclass(frozen=True)
class Shard:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, start + size)``, zero-padded
    to ``padded_size`` along ``dim`` when that is larger."""

    dim: int
    start: int
    size: int
    padded_size: int = 0


ZEROS_OFF_RANK0 = "zeros-off-rank0"  # a row-parallel bias


def shard_for(name: str, plan: TPPlan) -> Shard | str | None:
    """How rank ``plan.rank`` reads HF weight ``name``: a ``Shard``,
    ``ZEROS_OFF_RANK0``, or ``None`` (the whole tensor)."""
    d = plan.head_dim
    kind = name.rsplit(".", 1)[-1]
    module = name[: -len(kind) - 1]
    if module.endswith("self_attn.q_proj"):
        return Shard(0, plan.rank * plan.num_heads_per_rank * d, plan.num_heads_per_rank * d)
    if module.endswith(("self_attn.k_proj", "self_attn.v_proj")):
        return Shard(0, plan.kv_head_start * d, plan.num_kv_heads_per_rank * d)
    if module.endswith(("mlp.gate_proj", "mlp.up_proj")):
        n = plan.intermediate_per_rank
        return Shard(0, plan.rank * n, n)
    if module.endswith(("self_attn.o_proj", "mlp.down_proj")):
        if kind == "bias":
            return ZEROS_OFF_RANK0
        n = plan.num_heads_per_rank * d if module.endswith("o_proj") else plan.intermediate_per_rank
        return Shard(1, plan.rank * n, n)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Shard(0, plan.vocab_start, plan.num_vocab_rows, plan.vocab_per_rank)
    return None


def iter_rank_weights(files: list[str], plan: TPPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, this rank's cpu tensor)`` for every tensor of ``files``."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                rule = shard_for(name, plan)
                if rule is None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                if rule == ZEROS_OFF_RANK0:
                    shape = part.get_shape()
                    yield name, part[:] if plan.rank == 0 else torch.zeros(shape)
                    continue
                yield name, _read(part, rule)


def _read(part: Any, shard: Shard) -> torch.Tensor:
    stop = shard.start + shard.size
    tensor = part[shard.start : stop] if shard.dim == 0 else part[:, shard.start : stop]
    missing = shard.padded_size - shard.size
    if missing <= 0:
        return tensor
    pad_shape = list(tensor.shape)
    pad_shape[shard.dim] = missing
    return torch.cat((tensor, torch.zeros(pad_shape, dtype=tensor.dtype)), dim=shard.dim)


def load_rank_model(
    path: str,
    config: Any,
    dtype: str | torch.dtype,
    device: str | torch.device,
    plan: TPPlan,
    group: TPGroup,
) -> nn.Module:
    """Build rank ``plan.rank``'s model from the HF directory ``path`` (whose
    ``load_config`` is ``config``: rank 0 reads it once and hands it to the
    workers, sparing each the transformers import) and fill it from its slices."""
    from tandem.workers.checkpoints.loader import resolve_dtype, safetensors_files
    from tandem.workers.models import get_model_class
    from tandem.workers.parallel.layers import shard_model

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    model_cls = get_model_class(
        getattr(config, "architectures", None), getattr(config, "model_type", None)
    )
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device(device):
        net = model_cls(rank_config(config, plan), torch_dtype)
        shard_model(net, plan, group, torch_dtype)
    net.load_weights(iter_rank_weights(safetensors_files(path), plan))
    return net.eval()
