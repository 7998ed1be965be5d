"""The UCX environment the NIXL connector sets, and why.

UCX reads its ``UCX_*`` variables when a NIXL agent creates its UCX context,
so ``apply_ucx_env`` runs right before the agent is made (``NixlWorkerSide``).
A variable the operator already set is never touched: the defaults below
only fill gaps. What each one is for::

    variable                        devices  value  why
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY   cuda     on     D pulls KV with READs (ucp_get). UCX's
                                                    "auto" turns CUDA IPC get off when it
                                                    finds no NVLink, and VRAM->VRAM on one
                                                    node then goes over TCP loopback
                                                    (0.3-0.5 GB/s on an H100, issue #10)
                                                    instead of CUDA IPC (849 GB/s at 256 MiB).
    UCX_RCACHE_MAX_UNRELEASED       all      1024   bounds the registrations UCX's cache
                                                    keeps after release (vLLM sets the same
                                                    against a UCX memory leak).

Across nodes nothing is needed: UCX picks RDMA (rc/dc, GPUDirect when the
NIC can reach the GPU) from its default transport list, which is why the
connector never sets ``UCX_TLS``: narrowing it is the operator's call.
``probe.py`` reports what UCX chose.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

# variable -> (value, device types it applies to)
UCX_DEFAULTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": ("on", ("cuda",)),
    "UCX_RCACHE_MAX_UNRELEASED": ("1024", ("cpu", "cuda")),
}


def device_type(device: str) -> str:
    """``"cuda"`` for ``cuda`` / ``cuda:N``, ``"cpu"`` for ``cpu``; ValueError otherwise."""
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"KVTransferConfig.device must be cpu or cuda[:N], got {device!r}")
    return kind


def ucx_env_defaults(device: str) -> dict[str, str]:
    """What the connector wants set for a KV cache on ``device``."""
    kind = device_type(device)
    return {name: value for name, (value, kinds) in UCX_DEFAULTS.items() if kind in kinds}


def apply_ucx_env(
    device: str, environ: MutableMapping[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """Set the defaults for ``device`` that ``environ`` (default ``os.environ``)
    lacks. Returns ``(set now, kept from the operator)``; both are logged."""
    env = os.environ if environ is None else environ
    applied: dict[str, str] = {}
    kept: dict[str, str] = {}
    for name, value in ucx_env_defaults(device).items():
        if name in env:
            kept[name] = env[name]
        else:
            env[name] = value
            applied[name] = value
    if applied:
        logger.info("UCX settings for a %s KV cache: %s", device, applied)
    for name, value in kept.items():
        logger.info("UCX: keeping the operator's %s=%s", name, value)
    return applied, kept
