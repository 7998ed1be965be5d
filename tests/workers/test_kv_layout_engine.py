"""The head-major KV layout (workers/runner/kv_cache.py) is only a change of strides:
greedy output still equals transformers through chunked prefill and the CPU
dense-decode path, and the cache really is head-major (prefix hits and
preemption in head-major: tests/workers/test_engine.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.runner.kv_cache import allocate_kv_cache
from tests.workers.hf_checkpoints import load_hf_model
from tests.workers.test_engine import GREEDY, hf_greedy, prompts_for


def test_allocate_layouts_share_the_logical_shape():
    args = (5, 3, 4, 2, 8, torch.float32, torch.device("cpu"))
    blocks_first = allocate_kv_cache(*args)
    head_major = allocate_kv_cache(*args, layout="head_major")
    assert blocks_first.shape == head_major.shape == (5, 3, 2, 4, 2, 8)
    assert blocks_first.is_contiguous() and not head_major.is_contiguous()
    # storage [blk, H, L, 2, bs, d]: one head of one block is 3*2*4*8 consecutive elements
    assert head_major.stride() == (2 * 3 * 2 * 4 * 8, 2 * 4 * 8, 4 * 8, 8, 3 * 2 * 4 * 8, 1)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        allocate_kv_cache(*args, layout="layers_first")
    with pytest.raises(ValueError, match="kv_layout must be blocks_first or head_major"):
        EngineConfig.from_flat(kv_layout="heads")


def test_head_major_greedy_equals_transformers(make_checkpoint):
    # GQA (4 query heads on 2 KV heads), head_dim 48, chunked prefill
    path = make_checkpoint("llama_head_dim48")
    block_size, budget = 16, 64
    llm = LLM(
        EngineConfig.from_flat(
            model=path,
            block_size=block_size,
            max_num_batched_tokens=budget,
            num_kv_blocks=64,
            kv_layout="head_major",
        )
    )
    assert llm.engine.kv_cache.permute(0, 4, 1, 2, 3, 5).is_contiguous()
    prompts = prompts_for(block_size, budget)
    results = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    hf = load_hf_model(path)
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf, prompt), f"prompt of {len(prompt)} tokens"
    llm.engine.check_integrity()
