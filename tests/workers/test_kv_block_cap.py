"""The memory-sized KV block count is capped (workers/runner/kv_cache.py, MAX_AUTO_KV_BLOCKS): a
tiny model on a large GPU would otherwise get millions of blocks, each with scheduler state,
NIXL descriptors and an integrity walk. The arithmetic, on a fake 80 GB GPU."""

from __future__ import annotations

import logging

import torch

from tandem.workers.runner.kv_cache import (
    MAX_AUTO_KV_BLOCKS,
    bytes_per_block,
    gpu_kv_budget_bytes,
    num_blocks_for,
)

GB = 10**9
CUDA = torch.device("cuda")  # a device object only: the fakes below answer for it
TOTAL, WEIGHTS = 80 * GB, 1 * GB


def _blocks(block_bytes: int, num_kv_blocks: int | None = None) -> int:
    return num_blocks_for(
        block_bytes=block_bytes,
        num_kv_blocks=num_kv_blocks,
        kv_cache_memory=None,
        gpu_memory_utilization=0.9,
        device=CUDA,
        mem_get_info=lambda dev: (TOTAL - WEIGHTS, TOTAL),
        memory_reserved=lambda dev: WEIGHTS,
        outside_torch=lambda dev: 0,
    )


def _budget() -> int:
    return gpu_kv_budget_bytes(
        total_bytes=TOTAL, free_bytes=TOTAL - WEIGHTS, own_bytes=WEIGHTS,
        gpu_memory_utilization=0.9, step_bytes=0,
    )  # fmt: skip


def test_a_tiny_model_on_a_large_gpu_gets_the_capped_count(caplog):
    # the tests' tiny llama (tests/workers/hf_checkpoints.py): 2 layers, 2 KV heads of 16, fp32
    tiny = bytes_per_block(2, 16, 2, 16, torch.float32)
    assert _budget() // tiny > 8 * MAX_AUTO_KV_BLOCKS  # ~8.7M blocks uncapped
    with caplog.at_level(logging.INFO, logger="tandem.workers.runner.kv_cache"):
        assert _blocks(tiny) == MAX_AUTO_KV_BLOCKS
    assert "capped" in caplog.text


def test_real_models_stay_below_the_cap_and_explicit_counts_win():
    llama_1b = bytes_per_block(16, 16, 8, 64, torch.bfloat16)  # Llama-3.2-1B shape
    assert _blocks(llama_1b) == _budget() // llama_1b < MAX_AUTO_KV_BLOCKS
    tiny = bytes_per_block(2, 16, 2, 16, torch.float32)
    assert _blocks(tiny, num_kv_blocks=3 * MAX_AUTO_KV_BLOCKS) == 3 * MAX_AUTO_KV_BLOCKS
    cpu = num_blocks_for(
        block_bytes=tiny, num_kv_blocks=None, kv_cache_memory=64 * GB,
        gpu_memory_utilization=0.9, device=torch.device("cpu"),
    )  # fmt: skip
    assert cpu == MAX_AUTO_KV_BLOCKS


def test_capped_slot_ids_fit_the_graphs_int32_buffer():
    for block_size in (1, 16, 256, 1024):
        assert MAX_AUTO_KV_BLOCKS * block_size < 2**31
