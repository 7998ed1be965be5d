"""The sections of ``EngineConfig``, one dataclass each (``engine.py`` puts them
together). Every leaf is an ``option(...)`` (wire/config_fields.py): its default,
help, flag and whether a pool may set its own. A leaf named after the class that
consumes it (``lease_s``, ``side_channel_port``) keeps the flat key users write
(``kv_lease_s``, ``--kv-port``) through ``key=``.

The scheduling section extends the scheduler layer's own ``SchedulingConfig``;
the KV transfer section takes its defaults from ``KVTransferConfig``; the cache
section takes the ones it shares with ``SchedulerConfig`` from there: a default
is written once, where the setting is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.kvtransfer.config import KVTransferConfig
from tandem.scheduler.block_hash import HASH_ALGOS
from tandem.scheduler.config import SchedulerConfig, SchedulingConfig
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.wire.config_fields import default_of, option
from tandem.workers.graphs.sizes import (
    CUDA_GRAPH_MODES,
    DEFAULT_CUDA_GRAPH_MODE,
    check_cuda_graph_mode,
    parse_cuda_graph_sizes,
)


def _speculative_arg(text: str) -> dict[str, Any] | None:
    spec = SpeculativeConfig.from_dict(text)  # ValueError naming the field
    return spec.to_dict() if spec is not None else None


def _sizes_arg(text: str) -> list[int]:
    return parse_cuda_graph_sizes(text)


def _token_sizes_arg(text: str) -> list[int]:
    return parse_cuda_graph_sizes(text, "piecewise_graph_sizes")


@dataclass
class ModelConfig:
    """Which model, in which dtype, on which device."""

    name: str = option(
        "tiny",
        key="model",
        internal=True,
        help="'tiny', 'smollm2', a .gguf file, a local directory or a hub id "
        "(the command's --model)",
    )
    dtype: str = option("auto", help="auto | float32 | bfloat16 | float16")
    device: str = option("cpu", help="cpu or cuda")
    max_model_len: int | None = option(
        None, default_text="the model's context length, at most 4096",
        help="max prompt + output tokens",
    )  # fmt: skip
    seed: int = option(
        0,
        flag="--engine-seed",
        help="seed of the engine's sampler (the draws of requests that give no seed)",
    )


@dataclass
class CacheConfig:
    """The KV cache: its block size, its size, its byte layout, prefix caching."""

    block_size: int = option(default_of(SchedulerConfig, "block_size"), help="tokens per KV block")
    num_kv_blocks: int | None = option(
        None, per_pool=True, default_text="sized from memory",
        help="KV blocks (wins over memory sizing)",
    )  # fmt: skip
    kv_cache_memory: int | None = option(
        None, per_pool=True, default_text="1 GiB on CPU", help="bytes of KV cache (CPU)"
    )
    gpu_memory_utilization: float = option(
        0.9,
        per_pool=True,
        help="fraction of GPU memory the engine sizes weights + activations + graphs + KV "
        "cache to (a pool sharing a GPU: 0.9 x its fraction, at most the fraction)",
    )
    enable_prefix_caching: bool = option(
        default_of(SchedulerConfig, "enable_prefix_caching"),
        per_pool=True,
        flag="--no-prefix-caching",
        help="reuse the KV of cached prompt prefixes (--no-prefix-caching: off)",
    )
    prefix_caching_hash_algo: str = option(
        default_of(SchedulerConfig, "prefix_caching_hash_algo"),
        per_pool=True,
        help=f"prefix-cache block hash: {' | '.join(HASH_ALGOS)}",
    )
    # byte layout of the KV cache (workers/runner/kv_cache.py): "head_major" makes a head slice of
    # a block one piece: cheaper KV reads between engines of different tensor-parallel sizes
    kv_layout: str = option(
        default_of(KVTransferConfig, "kv_layout"), help="blocks_first | head_major (KV byte layout)"
    )
    # CPU fp32: the dense copy of decoding requests' KV (workers/runner/dense_decode.py)
    dense_decode_bytes: int | None = option(
        None, per_pool=True, default_text="the runner's default",
        help="CPU dense decode KV copy in bytes (0 = off)",
    )  # fmt: skip


@dataclass
class EngineSchedulingConfig(SchedulingConfig):
    """The scheduler's knobs (``SchedulingConfig``, scheduler/config.py) and the
    engine loop's: the overlapped loop, speculative decoding, grammar compiles."""

    structured_outputs_compile_timeout_s: float = option(
        30.0,
        per_pool=True,
        help="a constrained request whose grammar has not compiled by then ends in error",
    )
    # overlap: schedule step N+1 while step N runs (workers/runner/async_step.py); outputs are
    # those of the synchronous loop. Tensor-parallel engines run synchronous steps.
    async_scheduling: bool | None = option(
        None, per_pool=True, default_text="on with CUDA, off on CPU",
        help="schedule step N+1 while step N runs (same outputs as the synchronous loop)",
    )  # fmt: skip
    # speculative decoding (scheduler/spec/): vLLM's JSON shape; the decode pool of a P/D
    # cluster is the one that speculates (a prefill engine samples one token per request)
    speculative_config: dict[str, Any] | None = option(
        None,
        per_pool=True,
        parse=_speculative_arg,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft_model", '
        '"model": "smollm2", "num_speculative_tokens": 4}\' (synchronous loop, TP 1)',
    )


@dataclass
class ParallelConfig:
    """Tensor parallelism (workers/parallel/) and CPU threads."""

    tensor_parallel_size: int = option(
        1,
        per_pool=True,
        short="-tp",
        help="workers per engine sharing its weights and KV heads (the model's head "
        "counts must split N ways)",
    )
    # the longest rank 0 waits for a worker within a step; a worker whose heartbeat stops
    # for half of it is reported as unresponsive (workers/parallel/heartbeat.py)
    tp_step_timeout_s: float = option(
        60.0, per_pool=True, help="TP: fail the engine when a worker is silent this long in a step"
    )
    # Pin it on shared machines: torch's default OpenMP threads stall badly when another
    # process uses the same cores.
    torch_threads: int = option(
        0,
        per_pool=True,
        default_text="0 (tandem serve on CPU: the cores split between engines)",
        help="CPU torch threads per engine (0 = torch's default)",
    )


@dataclass
class GraphsConfig:
    """CUDA graphs (workers/graphs/; CPU ignores them), torch.compile, prefill attention."""

    cuda_graph_mode: str = option(
        DEFAULT_CUDA_GRAPH_MODE,
        per_pool=True,
        parse=check_cuda_graph_mode,
        help=f"CUDA: {' | '.join(CUDA_GRAPH_MODES)}: steps that replay graphs",
    )
    cuda_graph_sizes: list[int] | None = option(
        None,
        per_pool=True,
        parse=_sizes_arg,
        default_text="1,2,4,8,16,32,... up to max_num_seqs",
        help="CUDA: decode batch sizes captured as graphs, e.g. 1,2,4,8",
    )
    piecewise_graph_sizes: list[int] | None = option(
        None,
        per_pool=True,
        parse=_token_sizes_arg,
        default_text="1,2,4,8,16,32,... up to min(512, max_num_batched_tokens)",
        help="CUDA: step token counts captured piecewise, e.g. 16,32,64",
    )
    enforce_eager: bool = option(
        False, per_pool=True, help="CUDA: no CUDA graphs (every step eager), whatever the mode"
    )
    prefill_attention: str = option(
        "auto",
        per_pool=True,
        help="auto | triton | sdpa: prefix-free prefills through torch SDPA or the paged "
        "Triton kernel (auto: the paged kernel)",
    )
    compile_model: str = option(
        "auto",
        per_pool=True,
        help="auto | on | off: torch.compile the model's forward at start-up (auto: eager)",
    )


def _kv(name: str) -> Any:
    return default_of(KVTransferConfig, name)


@dataclass
class KVTransferSection:
    """The KV connector (kvtransfer/) and KV events (scheduler/kv_events.py). Its
    fields carry ``KVTransferConfig``'s names, so the connector's config takes the
    section as it is (workers/parallel/connector_hook.py)."""

    connector: str | None = option(
        None, key="kv_connector", internal=True, help='"nixl" to exchange KV with peers'
    )
    borrows_tiers: bool = option(
        False,
        key="kv_borrows_tiers",
        internal=True,
        help="a prefill engine without a host KV tier reads peers' (another pool keeps one)",
    )
    pool_moves: bool = option(
        False,
        key="kv_pool_moves",
        internal=True,
        help="the engine may move between the prefill and decode pools: it runs NIXL as "
        '"both" from its start (cluster/disagg/pool_move.py)',
    )
    side_channel_host: str = option(
        _kv("side_channel_host"), key="kv_host", internal=True,
        help="side-channel host peers connect to",
    )  # fmt: skip
    side_channel_port: int = option(
        _kv("side_channel_port"), key="kv_port",
        help="KV side-channel port of each engine (0 = a free port)",
    )  # fmt: skip
    lease_s: float = option(
        _kv("lease_s"), key="kv_lease_s",
        help="how long a prefill engine holds a request's KV for the decode engine",
    )  # fmt: skip
    load_timeout_s: float = option(
        _kv("load_timeout_s"), key="kv_load_timeout_s",
        help="a decode engine gives up one KV load after this long",
    )  # fmt: skip
    load_failure_policy: str = option(
        _kv("load_failure_policy"),
        choices=("recompute", "fail"),
        help="a failed KV load: recompute the missing blocks on decode, or fail the request",
    )
    transport_probe: str = option(
        _kv("transport_probe"), key="kv_transport_probe", per_pool=True,
        help="auto | on | off: a start-up READ reports UCX's transport (auto: on with CUDA)",
    )  # fmt: skip
    # KV events for KV-aware routing: on when the router needs them; ZMQ PUB on
    # side_channel_host:kv_events_port, at most kv_events_queue_batches batches waiting
    kv_events: bool = option(False, internal=True, help="publish KV events (kv-aware routing)")
    kv_events_port: int = option(0, help="KV events PUB port of each engine (0 = a free port)")
    kv_events_queue_batches: int = option(1024, help="KV event batches waiting to be sent, at most")


@dataclass
class OffloadConfig:
    """KV offloading tiers below the device cache (kvtransfer/tiers/)."""

    kv_offloading_size: float | None = option(
        None, per_pool=True, metavar="GiB",
        help="host-memory KV tier of each engine in GiB (pinned on CUDA); unset: none. "
        "Engines with it lend tier prefixes to each other over NIXL (prefill and decode "
        "engines; a colocated pool of more than one engine gets NIXL for it). With "
        "--tensor-parallel-size > 1 each rank keeps this much for its KV shard, in colocated "
        "pools only (no lending over NIXL)",
    )  # fmt: skip
    kv_offloading_disk_dir: str | None = option(
        None, per_pool=True, metavar="DIR",
        help="disk KV tier directory (one sub-directory per engine, kept across restarts)",
    )  # fmt: skip
    kv_offloading_disk_size: float | None = option(
        None, per_pool=True, metavar="GiB",
        help="disk KV tier of each engine in GiB (with --kv-offloading-disk-dir)",
    )  # fmt: skip
    kv_offloading_disk_optional: bool = option(
        False, per_pool=True,
        help="an unusable --kv-offloading-disk-dir (not writable, unreadable, another "
        "configuration's blocks) is a warning and host-only service, not a start-up error",
    )  # fmt: skip


@dataclass
class OutputConfig:
    """Output backpressure towards the gateway (workers/engine/output_sender.py), profiling."""

    hwm_messages: int = option(
        1000, key="output_hwm_messages", per_pool=True, help="ZMQ send queue to the gateway"
    )
    backlog_messages: int = option(
        64, key="output_backlog_messages", per_pool=True, help="outputs held before pausing"
    )
    stall_timeout_s: float = option(
        60.0,
        key="output_stall_timeout_s",
        per_pool=True,
        help="cut streams when the gateway reads nothing this long",
    )
    profile_dir: str | None = option(
        None,
        default_text="off (POST /start_profile answers 400)",
        help="directory for the engines' torch profiler traces (POST /start_profile, "
        "/stop_profile)",
    )
    gateway_lost_after_s: float = option(
        10.0,
        per_pool=True,
        help="drop a gateway (aborting its requests) whose output connection is down this long",
    )


@dataclass
class RuntimeConfig:
    """What the command sets per engine (its id, role, restart count, secret, log
    format) and the test hooks."""

    engine_id: str = option(_kv("engine_id"), internal=True, help="engine id")
    epoch: int = option(0, internal=True, help="restart count")
    role: str = option("colocated", internal=True, help="prefill | decode | colocated")
    # Per-cluster secret of the internal planes (engine sockets, KV side channel): CURVE
    # keys are derived from it (wire/auth.py). None = plain ZMQ, the development mode of
    # in-process engines; ``tandem serve`` always sets one. Never printed.
    cluster_secret: bytes | None = option(
        None, repr=False, internal=True, help="internal planes' secret"
    )
    # applied by the Ray actor (cluster/observability/logging_setup.py)
    log_format: str = option("text", internal=True, help="engine log lines: text | json")
    extra: dict[str, Any] = option(
        default_factory=dict,
        per_pool=True,
        yaml_only=True,
        help="test hooks, passed to the engine as is",
    )
