"""The KV tiers' settings: ``--kv-offloading-size``, ``--kv-offloading-disk-dir``,
``--kv-offloading-disk-size`` (vLLM's names), checked where the engine config is
built so a bad value is a start-up error naming the flag.

Standard library only: ``workers/config/`` imports it for the check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """One engine's tiers, in bytes (0 = no such tier)."""

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    # an unusable disk directory: a warning and host-only service (else a start-up error)
    disk_optional: bool = False
    engine_id: str = ""
    model: str = ""  # the model the KV belongs to (part of the disk fingerprint)
    hash_algo: str = "sha256"
    block_size: int = 16
    kv_layout: str = "blocks_first"
    load_timeout_s: float = 30.0
    # most block stores queued at once; more are dropped (counted), never waited for
    max_store_queue: int = 4096
    # "through": store each full block once it is computed (background);
    # "eviction": store a block when the device cache evicts it (benchmarks only)
    store_policy: str = "through"
    # threads reading a load's disk blocks at once, each straight into its device block
    # (CPU; benchmarks/kv_tiers.py measured 1 / 2 / 4 / 8, docs/benchmarks.md)
    disk_readers: int = 4
    # tensor parallelism: each rank keeps its own KV shard's blocks (kvtransfer/tiers/ranks.py)
    tp_size: int = 1
    tp_rank: int = 0
    # test hook: this rank (> 0) flips every byte of its host tier as its first load
    # arrives, so that rank's loads fail their checksum while rank 0's succeed
    corrupt_host_on_rank: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_bytes)


def _gib(value: Any, flag: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{flag} must be a number of GiB > 0, got {value!r}")
    return float(value)


def check_tier_fields(cfg: Any) -> None:
    """ValueError naming the flag for a bad combination of the tier fields of an
    ``EngineConfig`` (duck-typed)."""
    host = cfg.offload.kv_offloading_size
    disk_dir = cfg.offload.kv_offloading_disk_dir
    disk = cfg.offload.kv_offloading_disk_size
    if host is not None:
        _gib(host, "--kv-offloading-size")
    if disk is not None:
        _gib(disk, "--kv-offloading-disk-size")
    if disk_dir is not None and (not isinstance(disk_dir, str) or not disk_dir):
        raise ValueError(f"--kv-offloading-disk-dir must be a directory path, got {disk_dir!r}")
    if (disk_dir is None) != (disk is None):
        raise ValueError(
            "--kv-offloading-disk-dir and --kv-offloading-disk-size go together: "
            "set both or neither"
        )
    if cfg.offload.kv_offloading_disk_optional and disk_dir is None:
        raise ValueError("--kv-offloading-disk-optional needs --kv-offloading-disk-dir")
    if host is None and disk is None:
        return
    if not cfg.cache.enable_prefix_caching:
        raise ValueError(
            "--kv-offloading-size / --kv-offloading-disk-size need prefix caching "
            "(drop --no-prefix-caching): tier blocks are found by their prefix hash"
        )
    if cfg.parallel.tensor_parallel_size > 1 and cfg.kv_transfer.connector:
        raise ValueError(
            "--kv-offloading-size / --kv-offloading-disk-size with tensor_parallel_size > 1 "
            f"need kv_connector unset, got {cfg.kv_transfer.connector!r} (prefill and decode pools "
            "exchange KV over NIXL): tier blocks cross engines only at tensor_parallel_size 1"
        )
    if disk_dir is not None and cfg.cache.prefix_caching_hash_algo == "builtin":
        raise ValueError(
            "--kv-offloading-disk-dir needs a stable block hash: --prefix-caching-hash-algo "
            "builtin is seeded per process (use sha256 or xxhash128)"
        )


def tier_config(cfg: Any) -> TierConfig:
    """The ``TierConfig`` of an ``EngineConfig`` (checked already). The engine's test
    hooks (``extra={"kv_tiers": {...}}``) may set the other fields."""
    fields = dict(
        host_bytes=int((cfg.offload.kv_offloading_size or 0) * GIB),
        disk_dir=cfg.offload.kv_offloading_disk_dir,
        disk_bytes=int((cfg.offload.kv_offloading_disk_size or 0) * GIB),
        disk_optional=bool(cfg.offload.kv_offloading_disk_optional),
        engine_id=cfg.runtime.engine_id or "engine",
        model=str(cfg.model.name),
        hash_algo=cfg.cache.prefix_caching_hash_algo,
        block_size=cfg.cache.block_size,
        kv_layout=cfg.cache.kv_layout,
        load_timeout_s=cfg.kv_transfer.load_timeout_s,
        tp_size=cfg.parallel.tensor_parallel_size,
    )
    fields.update((cfg.runtime.extra or {}).get("kv_tiers", {}))
    return TierConfig(**fields)


def fingerprint(config: TierConfig, dtype: str, block_shape: tuple[int, ...]) -> dict[str, Any]:
    """What a disk tier's blocks depend on: another value makes them garbage."""
    return {
        "format": 3,  # disk.py's files (3: segments of blocks; 2: one file a block)
        "model": config.model,
        "dtype": dtype,
        "kv_layout": config.kv_layout,
        "block_shape": list(block_shape),
        "block_size": config.block_size,
        "hash_algo": config.hash_algo,
    } | (
        # a rank's shard: another TP size (or rank) splits the KV heads otherwise
        {"tp_size": config.tp_size, "tp_rank": config.tp_rank} if config.tp_size > 1 else {}
    )


def disk_name(config: TierConfig) -> str:
    """The engine's (tensor-parallel: the rank's) directory under the disk tier's."""
    if config.tp_size == 1:
        return config.engine_id
    return f"{config.engine_id}.tp{config.tp_size}-rank{config.tp_rank}"


def fingerprint_id(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
