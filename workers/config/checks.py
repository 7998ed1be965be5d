"""``EngineConfig``'s checks: every bad value is a ``ValueError`` naming its setting, raised when
the config is built (``EngineConfig.__post_init__``), before any engine work. The scheduling
section checks its own knobs (``SchedulingConfig.__post_init__``); these are the rest and the
checks across sections."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.kvtransfer.tiers.config import check_tier_fields
from tandem.scheduler.block_hash import get_block_hasher
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.wire.config_fields import key_of
from tandem.workers.graphs.sizes import capture_sizes, check_cuda_graph_mode, piecewise_sizes

if TYPE_CHECKING:
    from tandem.workers.config.engine import EngineConfig

# EngineConfig.graphs.prefill_attention (kernels/prefill_attention.py)
PREFILL_ATTENTION_MODES = ("auto", "triton", "sdpa")
# EngineConfig.graphs.compile_model (workers/compile/)
COMPILE_MODEL_MODES = ("auto", "on", "off")


def _key(section: object, name: str) -> str:
    """The flat key of a section's leaf: what an error names."""
    cls = type(section)
    return key_of(cls, cls.__dataclass_fields__[name])  # type: ignore[attr-defined]


def _at_least_one(section: object, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 1:
            raise ValueError(f"{_key(section, name)} must be >= 1, got {getattr(section, name)}")


def _positive(section: object, *names: str) -> None:
    for name in names:
        if not getattr(section, name) > 0:
            raise ValueError(f"{_key(section, name)} must be > 0, got {getattr(section, name)}")


def _one_of(value: str, key: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")


def check_engine_config(cfg: EngineConfig) -> None:
    """Check ``cfg`` (and normalise ``cuda_graph_mode`` and ``speculative_config``)."""
    cache, sched, par, graphs = cfg.cache, cfg.scheduler, cfg.parallel, cfg.graphs
    out, kv = cfg.output, cfg.kv_transfer
    _at_least_one(cache, "block_size")
    _at_least_one(out, "hwm_messages", "backlog_messages")
    _at_least_one(kv, "kv_events_queue_batches")
    _positive(out, "gateway_lost_after_s", "stall_timeout_s")
    _positive(sched, "structured_outputs_compile_timeout_s")
    if isinstance(par.tensor_parallel_size, bool) or not (
        isinstance(par.tensor_parallel_size, int) and par.tensor_parallel_size >= 1
    ):
        raise ValueError(
            f"tensor_parallel_size must be an integer >= 1, got {par.tensor_parallel_size!r}"
        )
    _positive(par, "tp_step_timeout_s")
    if par.torch_threads < 0:
        raise ValueError(f"torch_threads must be >= 0, got {par.torch_threads}")
    if cache.num_kv_blocks is not None and cache.num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be >= 1, got {cache.num_kv_blocks}")
    if cache.kv_cache_memory is not None and cache.kv_cache_memory < 1:
        raise ValueError(f"kv_cache_memory must be >= 1 byte, got {cache.kv_cache_memory}")
    if not 0.0 < cache.gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {cache.gpu_memory_utilization}"
        )
    get_block_hasher(cache.prefix_caching_hash_algo)  # ValueError naming the field
    capture_sizes(sched.max_num_seqs, graphs.cuda_graph_sizes)  # names cuda_graph_sizes
    graphs.cuda_graph_mode = check_cuda_graph_mode(graphs.cuda_graph_mode)
    piecewise_sizes(sched.max_num_batched_tokens, graphs.piecewise_graph_sizes)
    check_tier_fields(cfg)  # --kv-offloading-*
    _one_of(graphs.prefill_attention, "prefill_attention", PREFILL_ATTENTION_MODES)
    _one_of(graphs.compile_model, "compile_model", COMPILE_MODEL_MODES)
    if graphs.compile_model == "on" and par.tensor_parallel_size > 1:
        raise ValueError("compile_model 'on' needs tensor_parallel_size 1")
    if kv.transport_probe not in ("auto", "on", "off"):
        raise ValueError(f"kv_transport_probe must be auto, on or off, got {kv.transport_probe!r}")
    if cache.kv_layout not in ("blocks_first", "head_major"):
        raise ValueError(f"kv_layout must be blocks_first or head_major, got {cache.kv_layout!r}")
    rt = cfg.runtime
    if rt.role not in ("prefill", "decode", "colocated"):
        raise ValueError(f"role must be prefill, decode or colocated, got {rt.role!r}")
    if rt.log_format not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, got {rt.log_format!r}")
    if kv.load_failure_policy not in ("recompute", "fail"):
        raise ValueError(
            f"load_failure_policy must be recompute or fail, got {kv.load_failure_policy!r}"
        )

    spec = SpeculativeConfig.from_dict(sched.speculative_config)  # names the field
    sched.speculative_config = spec.to_dict() if spec is not None else None
    if spec is not None and par.tensor_parallel_size > 1:
        raise ValueError("speculative_config needs tensor_parallel_size 1")

    from tandem.wire.auth import check_secret

    check_secret(rt.cluster_secret, "EngineConfig.cluster_secret")
