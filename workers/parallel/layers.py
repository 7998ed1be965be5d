"""Sharded layers of a tensor-parallel rank, swapped into an ordinary model.

``shard_model`` takes a model built from ``rank_config`` (column-parallel
layers are then already the rank's size: ``qkv_proj`` and ``gate_up_proj``
hold this rank's rows) and replaces:

    o_proj, down_proj   -> RowParallelLinear      (partial sums, all-reduced)
    embed_tokens        -> VocabParallelEmbedding (own vocab rows, all-reduced)
    lm_head             -> this rank's vocab rows; ``logits_gather`` joins them

Parameter names stay the HF names, so ``load_weights`` fills them from the
rank's slices (``workers/parallel/loading.py``). A row-parallel bias is
added once: rank 0 loads it, every other rank loads zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.models.layers import Embedding, Linear
from tandem.workers.parallel.group import TPGroup
from tandem.workers.parallel.plan import TPPlan


class RowParallelLinear(Linear):
    """``x`` holds this rank's input columns; output is the all-reduced sum."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group: TPGroup
    ) -> None:
        super().__init__(in_features, [out_features], bias, dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight, self.bias))


class VocabParallelEmbedding(Embedding):
    """Rows ``[vocab_start, vocab_start + vocab_per_rank)``; ids outside them
    give zeros here and their row on the rank that holds it (all-reduce)."""

    def __init__(self, plan: TPPlan, hidden_size: int, dtype: torch.dtype, group: TPGroup) -> None:
        super().__init__(plan.vocab_per_rank, hidden_size, dtype)
        self.vocab_start = plan.vocab_start
        self.num_rows = plan.num_vocab_rows
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class LogitsGather:
    """This rank's ``[N, vocab_per_rank]`` logits -> ``[N, vocab]`` on every rank."""

    def __init__(self, plan: TPPlan, group: TPGroup) -> None:
        self.vocab_size = plan.vocab_size
        self.group = group

    def __call__(self, local_logits: torch.Tensor) -> torch.Tensor:
        full = self.group.all_gather_last_dim(local_logits)
        return full[..., : self.vocab_size]


def shard_model(model: nn.Module, plan: TPPlan, group: TPGroup, dtype: torch.dtype) -> nn.Module:
    """Swap the sharded layers into ``model`` (built from ``rank_config``), in place.

    Call before loading weights; new parameters land on the current default
    device (build under ``with torch.device(...)``).
    """
    hidden = model.config.hidden_size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = _row_parallel(attn.o_proj, dtype, group)
        mlp.down_proj = _row_parallel(mlp.down_proj, dtype, group)
    model.model.embed_tokens = VocabParallelEmbedding(plan, hidden, dtype, group)
    if model.lm_head is not None:
        model.lm_head = Linear(hidden, [plan.vocab_per_rank], False, dtype, transposed=False)
    model.logits_gather = LogitsGather(plan, group)
    return model


def _row_parallel(layer: Linear, dtype: torch.dtype, group: TPGroup) -> RowParallelLinear:
    out_features, in_features = layer.weight.shape
    return RowParallelLinear(in_features, out_features, layer.bias is not None, dtype, group)
