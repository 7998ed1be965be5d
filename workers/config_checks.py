"""``EngineConfig``'s checks: every bad value is a ``ValueError`` naming its field, raised when
the config is built (``EngineConfig.__post_init__``), before any engine work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.kvtransfer.tiers.config import check_tier_fields
from tandem.scheduler.block_hash import get_block_hasher
from tandem.scheduler.policies import check_fields
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.workers.graphs.sizes import capture_sizes, check_cuda_graph_mode, piecewise_sizes

if TYPE_CHECKING:
    from tandem.workers.config import EngineConfig

# EngineConfig.prefill_attention (kernels/prefill_attention.py)
PREFILL_ATTENTION_MODES = ("auto", "triton", "sdpa")
# EngineConfig.compile_model (workers/compile/)
COMPILE_MODEL_MODES = ("auto", "on", "off")


def check_engine_config(cfg: EngineConfig) -> None:
    """Check ``cfg`` (and normalise ``cuda_graph_mode`` and ``speculative_config``)."""
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("output_hwm_messages", "output_backlog_messages", "kv_events_queue_batches"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if not cfg.gateway_lost_after_s > 0:
        raise ValueError(f"gateway_lost_after_s must be > 0, got {cfg.gateway_lost_after_s}")
    if not cfg.structured_outputs_compile_timeout_s > 0:
        raise ValueError(
            "structured_outputs_compile_timeout_s must be > 0, "
            f"got {cfg.structured_outputs_compile_timeout_s}"
        )
    if not cfg.output_stall_timeout_s > 0:
        raise ValueError(f"output_stall_timeout_s must be > 0, got {cfg.output_stall_timeout_s}")
    if isinstance(cfg.tensor_parallel_size, bool) or not (
        isinstance(cfg.tensor_parallel_size, int) and cfg.tensor_parallel_size >= 1
    ):
        raise ValueError(
            f"tensor_parallel_size must be an integer >= 1, got {cfg.tensor_parallel_size!r}"
        )
    if not cfg.tp_step_timeout_s > 0:
        raise ValueError(f"tp_step_timeout_s must be > 0, got {cfg.tp_step_timeout_s}")
    if cfg.torch_threads < 0:
        raise ValueError(f"torch_threads must be >= 0, got {cfg.torch_threads}")
    if cfg.num_kv_blocks is not None and cfg.num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be >= 1, got {cfg.num_kv_blocks}")
    if cfg.kv_cache_memory is not None and cfg.kv_cache_memory < 1:
        raise ValueError(f"kv_cache_memory must be >= 1 byte, got {cfg.kv_cache_memory}")
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}"
        )
    get_block_hasher(cfg.prefix_caching_hash_algo)  # ValueError naming the field
    capture_sizes(cfg.max_num_seqs, cfg.cuda_graph_sizes)  # names cuda_graph_sizes
    cfg.cuda_graph_mode = check_cuda_graph_mode(cfg.cuda_graph_mode)
    piecewise_sizes(cfg.max_num_batched_tokens, cfg.piecewise_graph_sizes)
    check_fields(cfg)  # policy, admission margin, partial prefill limits
    check_tier_fields(cfg)  # --kv-offloading-*
    if cfg.prefill_attention not in PREFILL_ATTENTION_MODES:
        raise ValueError(
            f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION_MODES)}, "
            f"got {cfg.prefill_attention!r}"
        )
    if cfg.compile_model not in COMPILE_MODEL_MODES:
        raise ValueError(
            f"compile_model must be one of {', '.join(COMPILE_MODEL_MODES)}, "
            f"got {cfg.compile_model!r}"
        )
    if cfg.compile_model == "on" and cfg.tensor_parallel_size > 1:
        raise ValueError("compile_model 'on' needs tensor_parallel_size 1")
    if cfg.kv_transport_probe not in ("auto", "on", "off"):
        raise ValueError(
            f"kv_transport_probe must be auto, on or off, got {cfg.kv_transport_probe!r}"
        )
    if cfg.kv_layout not in ("blocks_first", "head_major"):
        raise ValueError(f"kv_layout must be blocks_first or head_major, got {cfg.kv_layout!r}")
    if cfg.role not in ("prefill", "decode", "colocated"):
        raise ValueError(f"role must be prefill, decode or colocated, got {cfg.role!r}")
    if cfg.log_format not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, got {cfg.log_format!r}")
    if cfg.load_failure_policy not in ("recompute", "fail"):
        raise ValueError(
            f"load_failure_policy must be recompute or fail, got {cfg.load_failure_policy!r}"
        )

    spec = SpeculativeConfig.from_dict(cfg.speculative_config)  # names the field
    cfg.speculative_config = spec.to_dict() if spec is not None else None
    if spec is not None and cfg.tensor_parallel_size > 1:
        raise ValueError("speculative_config needs tensor_parallel_size 1")

    from tandem.wire.auth import check_secret

    check_secret(cfg.cluster_secret, "EngineConfig.cluster_secret")
