"""The device memory this process holds outside torch's allocator (CUDA, through NVML).

An engine's ``gpu_memory_utilization`` share must hold everything the engine's process holds
on the device. ``torch.cuda.memory_reserved`` counts only torch's caching allocator; the
process also holds its CUDA context and what the libraries it loads keep outside torch
(loaded kernel modules, library handles, NIXL/UCX state). On an H100 that was 2.6 GiB per
engine process, 0.6 GiB of it the context (``benchmarks/gpu_pd_memory.py``, docs/gpu.md):
two engines at 0.45 each left 2.2 GiB of the GPU free, and the start-up transport probe's
two CUDA processes ran out of memory.

Free memory is device-wide, so on a shared GPU it cannot tell this process's bytes from a
neighbour's. NVML lists each compute process's used memory by process id: that is the
figure here. Where NVML cannot say (no driver, no nvidia-ml-py, or a container whose process
ids NVML does not see), ``process_device_bytes`` returns None and the caller counts torch's
reservation alone, as before.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

# what a process may hold beyond its share before start-up warns (allocator rounding)
SHARE_SLACK_BYTES = 64 << 20


def _nvml_used_by(pid: int, uuid: str, nvml: Any) -> int | None:
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid:
                return proc.usedGpuMemory  # None where the driver withholds it
        return None
    finally:
        nvml.nvmlShutdown()


def process_device_bytes(
    device: torch.device, nvml: Any = None, uuid: str | None = None
) -> int | None:
    """Device bytes this process holds on ``device`` as NVML lists them (context, libraries
    and torch's reservation together), or None where NVML cannot say. The device is found by
    its UUID (NVML ignores CUDA_VISIBLE_DEVICES). ``nvml`` (the pynvml module) and ``uuid``:
    tests pass fakes."""
    if device.type != "cuda":
        return None
    try:
        if nvml is None:
            import pynvml as nvml
        if uuid is None:  # NVML names a GPU "GPU-<uuid>"
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        used = _nvml_used_by(os.getpid(), uuid, nvml)
    except Exception as e:  # noqa: BLE001 - any NVML failure: the figure is unknown
        logger.info("NVML cannot say what this process holds on %s (%s)", device, e)
        return None
    if used is None:
        logger.info(
            "NVML does not list this process (pid %d) on %s: its device memory outside "
            "torch is not counted in its share",
            os.getpid(),
            device,
        )
    return used


def outside_torch_bytes(device: torch.device, nvml: Any = None, uuid: str | None = None) -> int:
    """What this process holds on ``device`` beyond torch's reservation (0 where unknown)."""
    used = process_device_bytes(device, nvml, uuid)
    if used is None:
        return 0
    return max(0, used - torch.cuda.memory_reserved(device))


def log_share_held(device: torch.device, gpu_memory_utilization: float, nvml: Any = None) -> None:
    """After start-up (CUDA): what the process holds against its share, as NVML lists it; a
    warning where it holds more (what appeared outside torch after the KV cache was sized)."""
    used = process_device_bytes(device, nvml)
    if used is None:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    share = int(total * gpu_memory_utilization)
    gib = 2**30
    text = (
        f"this engine's process holds {used / gib:.2f} GiB of {device}, its share "
        f"{gpu_memory_utilization} x {total / gib:.2f} GiB = {share / gib:.2f} GiB (NVML; "
        f"torch reserved {torch.cuda.memory_reserved(device) / gib:.2f} GiB)"
    )
    if used > share + SHARE_SLACK_BYTES:
        logger.warning("%s: over its share (--gpu-memory-utilization)", text)
    else:
        logger.info("%s", text)
