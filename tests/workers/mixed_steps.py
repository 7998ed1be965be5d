"""Two steps of a model over a paged cache, the second one mixed (a decode, a later chunk, a new
prompt), for tests comparing two attention or compile paths on hidden states."""

from __future__ import annotations

import torch

from tandem.kernels import AttentionMetadata

BLOCK_SIZE = 16
# (sequence, seq_len, query_len) per step; every block id below 32
STEPS = [[("a", 40, 40), ("b", 20, 20)], [("a", 41, 1), ("b", 50, 30), ("c", 90, 90)]]
TABLES = {"a": [3, 7, 30], "b": [1, 9, 4, 22], "c": [12, 2, 5, 11, 8, 20]}
# the same kinds of sequences, short enough for the Triton interpreter
SMALL_STEPS = [[("a", 6, 6), ("b", 3, 3)], [("a", 7, 1), ("b", 20, 17), ("c", 5, 5), ("d", 12, 12)]]
SMALL_TABLES = {"a": [3], "b": [1, 9], "c": [12], "d": [5]}


def new_kv_cache(model: torch.nn.Module, device: str = "cpu") -> torch.Tensor:
    shape = (32, model.num_layers, 2, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=model.dtype, device=device)


def last_step_hidden(
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    sdpa_prefills: bool = False,
    steps: list = STEPS,
    tables: dict = TABLES,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Run ``steps`` (seeded token ids) and return the last step's hidden states (float32)
    and its metadata."""
    device = kv_cache.device
    g = torch.Generator().manual_seed(0)
    for step in steps:
        ids = torch.randint(3, 300, (sum(q for _, _, q in step),), generator=g).to(device)
        positions = torch.cat([torch.arange(s - q, s) for _, s, q in step]).to(device)
        meta = AttentionMetadata.build(
            [tables[name] for name, _, _ in step],
            [s for _, s, _ in step],
            [q for _, _, q in step],
            BLOCK_SIZE,
            device,
        )
        meta.sdpa_prefills = sdpa_prefills
        with torch.inference_mode():
            hidden = model(ids, positions, kv_cache, meta).float()
    return hidden, meta
