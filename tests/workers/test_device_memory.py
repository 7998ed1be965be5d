"""What an engine's process holds outside torch, as NVML lists it (a fake NVML, no CUDA)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from tandem.workers.runner.device_memory import outside_torch_bytes, process_device_bytes

GIB = 2**30
CUDA = torch.device("cuda", 0)  # a device object only: nothing touches CUDA
UUID = "GPU-0d6c3a3e-1111-2222-3333-444455556666"


class NVMLError(Exception):
    pass


class FakeNvml:
    """pynvml's calls that ``device_memory`` makes, over one device's process list."""

    def __init__(self, processes: dict[int, int | None], uuid: str = UUID) -> None:
        self.processes, self.uuid = processes, uuid
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.inits += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802
        if uuid != self.uuid:
            raise NVMLError(f"no device {uuid}")
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list:  # noqa: N802
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.processes.items()]


def test_this_process_is_found_by_pid_among_its_neighbours():
    nvml = FakeNvml({1: 30 * GIB, os.getpid(): 38 * GIB, 2: GIB // 2})
    assert process_device_bytes(CUDA, nvml, UUID) == 38 * GIB
    assert nvml.inits == nvml.shutdowns == 1  # NVML is shut down again


def test_outside_torch_is_what_nvml_lists_beyond_torchs_reservation():
    # no CUDA here: torch reserved 0, so everything NVML lists is outside torch
    nvml = FakeNvml({os.getpid(): 3 * GIB})
    assert outside_torch_bytes(CUDA, nvml, UUID) == 3 * GIB


def test_unknown_figures_count_nothing():
    # NVML does not list this process (a container with its own pids), withholds the
    # figure, or fails; off CUDA nothing is asked
    assert process_device_bytes(CUDA, FakeNvml({1: GIB}), UUID) is None
    assert process_device_bytes(CUDA, FakeNvml({os.getpid(): None}), UUID) is None
    assert process_device_bytes(CUDA, FakeNvml({os.getpid(): GIB}), "GPU-other") is None
    assert outside_torch_bytes(CUDA, FakeNvml({1: GIB}), UUID) == 0
    assert process_device_bytes(torch.device("cpu"), FakeNvml({os.getpid(): GIB}), UUID) is None
