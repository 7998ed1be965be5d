"""Drive a model step by step over a paged KV cache, as a model runner would.

Each sequence gets shuffled, non-contiguous block ids, so a wrong slot or
block-table lookup shows up as wrong logits.
"""

from __future__ import annotations

import random

import torch

from tandem.kernels import AttentionMetadata


class PagedSession:
    """``step({seq: new_token_ids}) -> {seq: logits [len(new), vocab]}``."""

    def __init__(
        self, model: torch.nn.Module, block_size: int, num_blocks: int = 64, seed: int = 0
    ):
        self.model = model
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            num_blocks,
            model.num_layers,
            2,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            dtype=model.dtype,
        )
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        tables, seq_lens, query_lens, ids, positions = [], [], [], [], []
        for seq, tokens in new_tokens.items():
            start = self.seq_lens.get(seq, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            self.seq_lens[seq] = end
            tables.append(table)
            seq_lens.append(end)
            query_lens.append(len(tokens))
            ids += tokens
            positions += range(start, end)
        meta = AttentionMetadata.build(tables, seq_lens, query_lens, self.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_cache, meta)
            logits = self.model.compute_logits(hidden)
        out, offset = {}, 0
        for seq, tokens in new_tokens.items():
            out[seq] = logits[offset : offset + len(tokens)]
            offset += len(tokens)
        return out
