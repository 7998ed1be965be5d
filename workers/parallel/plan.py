"""What one tensor-parallel rank holds: heads, KV heads, MLP columns, vocab rows.

Megatron split of a Llama-family layer over ``N`` ranks (rank ``r``)::

    q_proj    rows of query heads   [r*H/N, (r+1)*H/N)             column-parallel
    k/v_proj  rows of KV heads      kv_head_start .. + kv_heads     column-parallel
    o_proj    columns of its q heads, then all-reduce               row-parallel
    gate/up   rows [r*I/N, (r+1)*I/N)                               column-parallel
    down      columns [r*I/N, ...), then all-reduce                 row-parallel
    embed     vocab rows [r*Vp, (r+1)*Vp), Vp = ceil(V/N), padded   vocab-parallel
    lm_head   same rows; logits gathered along the vocab            vocab-parallel

KV heads: with ``Hkv % N == 0`` rank ``r`` holds ``Hkv/N`` of them; with
``N % Hkv == 0`` (more ranks than KV heads) each rank holds ONE whole KV head,
``r // (N/Hkv)``, replicated on ``N/Hkv`` ranks, as vLLM does: the query heads
of rank ``r`` all belong to that KV head's group, so attention stays local.
A rank's KV cache is ``[num_blocks, L, 2, block_size, kv_heads_per_rank, D]``.

A rank's model is the ordinary model class built from ``rank_config`` (the
same config with this rank's head and MLP counts) with the row-parallel and
vocab-parallel layers swapped in (``workers/parallel/layers.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TPPlan:
    tp_size: int
    rank: int
    num_heads: int  # query heads of the model
    num_kv_heads: int  # KV heads of the model
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def num_heads_per_rank(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def num_kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_head_start(self) -> int:
        """First KV head (model numbering) this rank holds."""
        if self.num_kv_heads >= self.tp_size:
            return self.rank * self.num_kv_heads_per_rank
        return self.rank // (self.tp_size // self.num_kv_heads)

    @property
    def kv_replication(self) -> int:
        """How many ranks hold each KV head (1: no replication)."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def vocab_per_rank(self) -> int:
        """Vocab rows per rank, the last rank's padded up to this count."""
        return -(-self.vocab_size // self.tp_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def num_vocab_rows(self) -> int:
        """Real (unpadded) vocab rows of this rank."""
        return max(
            0, min(self.vocab_size, self.vocab_start + self.vocab_per_rank) - self.vocab_start
        )


def make_plan(config: Any, tp_size: int, rank: int) -> TPPlan:
    """This rank's plan for an HF config; ``ValueError`` naming the field that
    ``tensor_parallel_size`` does not divide (see module docstring)."""
    from tandem.workers.models.llama import head_dim_of

    check_tensor_parallel(config, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")
    heads = int(config.num_attention_heads)
    return TPPlan(
        tp_size=tp_size,
        rank=rank,
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim_of(config),
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
    )


def check_tensor_parallel(config: Any, tp_size: int) -> None:
    """``ValueError`` naming the model field when ``tp_size`` cannot split it."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's num_attention_heads ({heads})"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} and the model's num_key_value_heads ({kv_heads}) "
            "must divide one another (KV heads are split, or replicated when fewer than ranks)"
        )
    inter = int(config.intermediate_size)
    if inter % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's intermediate_size ({inter})"
        )


def rank_config(config: Any, plan: TPPlan) -> Any:
    """A copy of ``config`` describing one rank's slice of every layer."""
    local = copy.deepcopy(config)
    local.head_dim = plan.head_dim  # explicit: hidden / heads no longer gives it
    local.num_attention_heads = plan.num_heads_per_rank
    local.num_key_value_heads = plan.num_kv_heads_per_rank
    local.intermediate_size = plan.intermediate_per_rank
    return local
