"""An engine sized by ``gpu_memory_utilization`` on the test GPU, for the tests that check it
stays inside its share: a checkpoint big enough for graphs and activations to matter, the
device's state before the engine starts, prompts that make full-budget steps, and the check
of what the engine holds after them."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

MIB = 2**20
VOCAB = 32000


def share_checkpoint(make_checkpoint: Any) -> str:
    """A Llama checkpoint big enough for the graphs and activations to matter next to the
    64 MiB slack of ``assert_inside_share``."""
    return make_checkpoint(
        "llama",
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )


@dataclass
class DeviceBefore:
    free_bytes: int
    total_bytes: int
    reserved_bytes: int  # torch's already: the engine counts it as its own


def device_before() -> DeviceBefore:
    """The device after freeing what torch caches, before the engine starts."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return DeviceBefore(free, total, torch.cuda.memory_reserved())


def full_budget_prompts() -> list[list[int]]:
    """Prompts of 500, 200, 30, 7 and 28 x 5 tokens: with a 512-token budget and 32 sequences,
    chunked full-budget steps and wide decode batches."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (500, 7, 30, 200)]
    return prompts + [torch.randint(3, VOCAB, (5,), generator=g).tolist() for _ in range(28)]


def assert_inside_share(engine: Any, before: DeviceBefore, share: float) -> None:
    """What the device lost since ``before`` plus torch's reserve then is within ``share`` of
    it (64 MiB for what torch does not allocate: kernel images, cuBLAS handles), and weights
    + profiled activations and graphs + KV cache fit the share."""
    torch.cuda.synchronize()
    grown = before.free_bytes - torch.cuda.mem_get_info()[0]
    limit = share * before.total_bytes
    assert before.reserved_bytes + grown <= limit + 64 * MIB, (before, grown)
    kv_bytes = engine.kv_cache.numel() * engine.kv_cache.element_size()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert weights + engine.step_memory.num_bytes + kv_bytes <= limit - before.reserved_bytes
