"""KV cache sizing on a GPU that engines share (fake mem_get_info, no CUDA)."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.runner.kv_cache import gpu_kv_budget_bytes, num_blocks_for

GIB = 2**30
CUDA = torch.device("cuda", 0)  # a device object only: nothing touches CUDA


class FakeGpu:
    """One 80 GiB device shared by processes; each holds a CUDA context
    (outside torch's allocator) plus what its allocator reserved."""

    CONTEXT = GIB // 2

    def __init__(self, total: int = 80 * GIB) -> None:
        self.total = total
        self.reserved: dict[str, int] = {}

    def start(self, name: str, weights: int) -> None:
        self.reserved[name] = weights

    def used(self) -> int:
        return sum(self.reserved.values()) + self.CONTEXT * len(self.reserved)

    def size_kv(
        self, name: str, utilization: float, block_bytes: int, nvml_sees: bool = True
    ) -> int:
        """``num_blocks_for`` as engine ``name`` sees the device, then its allocation.
        ``nvml_sees``: whether NVML lists the process (its context is then counted)."""
        n = num_blocks_for(
            block_bytes=block_bytes,
            num_kv_blocks=None,
            kv_cache_memory=None,
            gpu_memory_utilization=utilization,
            device=CUDA,
            mem_get_info=lambda dev: (self.total - self.used(), self.total),
            memory_reserved=lambda dev: self.reserved[name],
            outside_torch=lambda dev: self.CONTEXT if nvml_sees else 0,
        )
        self.reserved[name] += n * block_bytes
        return n


@pytest.mark.parametrize("order", [("prefill", "decode"), ("decode", "prefill")])
def test_two_engines_on_one_gpu_each_get_their_own_share(order):
    gpu, block = FakeGpu(), 2 * 2**20
    weights = {"prefill": 3 * GIB, "decode": 2 * GIB}
    blocks = {}
    for name in order:  # weights are loaded before the KV cache is sized
        gpu.start(name, weights[name])
    for name in order:
        blocks[name] = gpu.size_kv(name, 0.45, block)
    for name in order:
        # each: 0.45 x 80 GiB minus its own weights and context, whoever came first
        assert blocks[name] == (int(0.45 * gpu.total) - weights[name] - FakeGpu.CONTEXT) // block
        assert gpu.reserved[name] + FakeGpu.CONTEXT <= 0.45 * gpu.total
    # the whole rest of the GPU stays free, for the processes beside the engines (the
    # transport probe's two CUDA processes, the gateway)
    assert gpu.total - gpu.used() >= 0.1 * gpu.total


def test_a_process_nvml_does_not_list_counts_its_torch_reservation_alone():
    gpu, block = FakeGpu(), 2**20
    gpu.start("decode", 2 * GIB)
    n = gpu.size_kv("decode", 0.45, block, nvml_sees=False)
    assert n == (int(0.45 * gpu.total) - 2 * GIB) // block


def test_second_engine_started_after_the_first_has_its_kv_still_gets_its_share():
    gpu, block = FakeGpu(), 2**20
    gpu.start("prefill", 4 * GIB)
    first = gpu.size_kv("prefill", 0.5, block)
    gpu.start("decode", 4 * GIB)  # the device now shows 0.5 used
    second = gpu.size_kv("decode", 0.4, block)
    assert first == (40 * GIB - 4 * GIB - FakeGpu.CONTEXT) // block
    assert second == (int(0.4 * gpu.total) - 4 * GIB - FakeGpu.CONTEXT) // block


def test_other_processes_holding_more_than_the_rest_is_an_error_naming_the_flag():
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.6") as info:
        gpu_kv_budget_bytes(
            total_bytes=80 * GIB, free_bytes=30 * GIB, own_bytes=2 * GIB, gpu_memory_utilization=0.6
        )
    assert "--decode-gpu-memory-utilization" in str(info.value)


def test_one_engine_alone_keeps_the_old_budget_minus_only_its_weights():
    budget = gpu_kv_budget_bytes(
        total_bytes=80 * GIB,
        free_bytes=80 * GIB - 5 * GIB - GIB // 2,
        own_bytes=5 * GIB,
        gpu_memory_utilization=0.9,
    )
    assert budget == int(0.9 * 80 * GIB) - 5 * GIB
