"""Activation and CUDA-graph memory out of the KV budget, without CUDA: the budget arithmetic
on measured byte counts (one engine, two engines sharing a GPU, the error naming the flag),
and the profiling step itself on a CPU model (a one-block dummy cache, nothing written, any
step size). The measurement on a device is tests/gpu/test_cuda_piecewise.py's."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.checkpoints.loader import load_model
from tandem.workers.config import EngineConfig
from tandem.workers.graphs.memory import StepMemory, profile_forward, profile_step_memory
from tandem.workers.runner.kv_cache import allocate_kv_cache, gpu_kv_budget_bytes, num_blocks_for
from tests.workers import hf_checkpoints

GIB, MIB = 2**30, 2**20
CUDA = torch.device("cuda", 0)  # a device object only: nothing touches CUDA


def test_step_bytes_come_out_of_the_share_not_out_of_the_rest_of_the_gpu():
    # 80 GiB device, share 0.5 = 40 GiB: weights 3 GiB, activations 1.5 GiB, graphs 0.5 GiB
    step = StepMemory(activation_bytes=3 * GIB // 2, graph_bytes=GIB // 2)
    budget = gpu_kv_budget_bytes(
        total_bytes=80 * GIB,
        free_bytes=76 * GIB,
        own_bytes=3 * GIB,
        gpu_memory_utilization=0.5,
        step_bytes=step.num_bytes,
    )
    assert budget == 35 * GIB
    assert 3 * GIB + step.num_bytes + budget == 40 * GIB  # weights + steps + KV = the share
    # without step bytes: the old budget, which overshot the share by them
    old = gpu_kv_budget_bytes(
        total_bytes=80 * GIB, free_bytes=76 * GIB, own_bytes=3 * GIB, gpu_memory_utilization=0.5
    )
    assert old - budget == 2 * GIB


def test_two_engines_with_graphs_each_stay_inside_their_share():
    total, block = 80 * GIB, 2 * MIB
    held: dict[str, int] = {"prefill": 3 * GIB, "decode": 2 * GIB}  # weights loaded first
    steps = {"prefill": StepMemory(2 * GIB, 0), "decode": StepMemory(GIB // 4, 700 * MIB)}
    for name in ("prefill", "decode"):
        n = num_blocks_for(
            block_bytes=block,
            num_kv_blocks=None,
            kv_cache_memory=None,
            gpu_memory_utilization=0.45,
            device=CUDA,
            mem_get_info=lambda dev: (total - sum(held.values()), total),
            memory_reserved=lambda dev, name=name: held[name],
            outside_torch=lambda dev: 0,  # the fake device: nothing outside torch
            step_bytes=steps[name].num_bytes,
        )
        held[name] += n * block + steps[name].num_bytes  # KV, then its steps and graphs
        assert held[name] <= 0.45 * total
        assert held[name] > 0.45 * total - block  # and nothing is left on the table
    assert total - sum(held.values()) >= 0.1 * total - 2 * block


def test_step_bytes_that_do_not_fit_name_the_flag():
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.5"):
        gpu_kv_budget_bytes(
            total_bytes=80 * GIB,
            free_bytes=36 * GIB,  # the KV would fit, KV + steps would not
            own_bytes=3 * GIB,
            gpu_memory_utilization=0.5,
            step_bytes=2 * GIB,
        )
    with pytest.raises(ValueError, match="after 1073741824 bytes of activations and CUDA"):
        num_blocks_for(
            block_bytes=MIB,
            num_kv_blocks=None,
            kv_cache_memory=None,
            gpu_memory_utilization=0.1,
            device=CUDA,
            mem_get_info=lambda dev: (70 * GIB, 80 * GIB),
            memory_reserved=lambda dev: 7 * GIB,
            outside_torch=lambda dev: 0,
            step_bytes=GIB,  # 8 GiB share - 7 - 1: no block left
        )


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = hf_checkpoints.make_checkpoint(
        "llama", tmp_path_factory.mktemp("ckpt-mem"), num_hidden_layers=2
    )
    model, _ = load_model(path, "float32", "cpu")
    return model


@pytest.mark.parametrize(
    "num_tokens,max_model_len,sdpa", [(48, 64, False), (150, 64, True), (7, 16, False)]
)
def test_profiling_step_runs_any_size_over_one_block_and_writes_nothing(
    llama, num_tokens, max_model_len, sdpa
):
    cache = allocate_kv_cache(
        1, llama.num_layers, 4, llama.num_kv_heads, llama.head_dim, torch.float32, "cpu"
    )
    profile_forward(llama, cache, 4, num_tokens, max_model_len, 5, sdpa_prefills=sdpa)
    assert torch.count_nonzero(cache) == 0


def test_nothing_is_profiled_off_cuda_or_when_the_user_sized_the_cache(llama):
    assert profile_step_memory(EngineConfig.from_flat(), llama, 64) == StepMemory()
    for sized in ({"num_kv_blocks": 8}, {"kv_cache_memory": GIB}, {"tensor_parallel_size": 2}):
        config = EngineConfig.from_flat(
            device="cuda", **sized
        )  # returns before touching the device
        assert profile_step_memory(config, llama, 64) == StepMemory()
