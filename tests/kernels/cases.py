"""Shared builders for kernel tests: random paged caches and a naive float64 oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import AttentionMetadata

NUM_LAYERS = 3
LAYER = 1  # the layer under test; its view of the blocks-first cache is non-contiguous


@dataclass
class Case:
    query: torch.Tensor  # [num_tokens, Hq, D]
    key: torch.Tensor  # [num_tokens, Hkv, D], this step's keys
    value: torch.Tensor
    kv_cache: torch.Tensor  # [num_blocks, NUM_LAYERS, 2, block_size, Hkv, D]
    meta: AttentionMetadata
    block_tables: list[list[int]]
    scale: float

    @property
    def layer_cache(self) -> torch.Tensor:
        return self.kv_cache[:, LAYER]


def make_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_spare_blocks: int = 3,
) -> Case:
    """``seqs`` = [(seq_len, query_len)]. The prior context (seq_len - query_len positions) is
    already in the cache; this step's K/V are returned, not yet written. Unused cache slots hold
    finite junk so masking is exercised."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s, _ in seqs]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables, used = [], 0
    for n in blocks_per_seq:
        block_tables.append(order[used : used + n])
        used += n
    shape = (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
    kv_cache = (torch.rand(shape, generator=gen) * 8 - 4).to(dtype)

    seq_lens = [s for s, _ in seqs]
    query_lens = [q for _, q in seqs]
    # Prior context of every sequence, written with plain indexing (independent of the kernels).
    layer_cache = kv_cache[:, LAYER]
    for table, (seq_len, query_len) in zip(block_tables, seqs, strict=True):
        for pos in range(seq_len - query_len):
            block, offset = table[pos // block_size], pos % block_size
            layer_cache[block, :, offset] = torch.randn(
                2, num_kv_heads, head_dim, generator=gen
            ).to(dtype)
    num_tokens = sum(query_lens)
    meta = AttentionMetadata.build(block_tables, seq_lens, query_lens, block_size, "cpu")

    def rnd(h: int) -> torch.Tensor:
        return torch.randn(num_tokens, h, head_dim, generator=gen).to(dtype)

    return Case(
        query=rnd(num_heads),
        key=rnd(num_kv_heads),
        value=rnd(num_kv_heads),
        kv_cache=kv_cache,
        meta=meta,
        block_tables=block_tables,
        scale=head_dim**-0.5,
    )


def write_oracle(case: Case) -> None:
    """Write this step's K/V token by token with plain indexing, honouring slot -1."""
    block_size = case.layer_cache.shape[2]
    for t, slot in enumerate(case.meta.slot_mapping.tolist()):
        if slot < 0:
            continue
        case.layer_cache[slot // block_size, 0, slot % block_size] = case.key[t]
        case.layer_cache[slot // block_size, 1, slot % block_size] = case.value[t]


def attention_oracle(case: Case) -> torch.Tensor:
    """Naive float64 attention: gather every token's context position by position."""
    meta, cache = case.meta, case.layer_cache.double()
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    num_tokens, num_heads, head_dim = case.query.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    t = 0
    for table, seq_len, query_len in zip(
        case.block_tables, meta.seq_lens_list, meta.query_lens_list, strict=True
    ):
        for j in range(query_len):
            pos = seq_len - query_len + j
            slots = [(table[p // block_size], p % block_size) for p in range(pos + 1)]
            k = torch.stack([cache[b, 0, o] for b, o in slots])  # [ctx, Hkv, D]
            v = torch.stack([cache[b, 1, o] for b, o in slots])
            for h in range(num_heads):
                q = case.query[t, h].double()
                scores = k[:, h // group] @ q * case.scale
                out[t, h] = torch.softmax(scores, 0) @ v[:, h // group]
            t += 1
    return out
