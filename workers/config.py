"""Engine configuration: one typed place for every engine setting.

Each field of ``EngineConfig`` carries its default, help, section and whether
a pool may set its own (``wire/config_fields.py``): ``tandem generate``'s
flags (``add_engine_arguments``), ``tandem serve``'s engine flags, per-pool
flags (``--decode-max-num-seqs``) and YAML keys, and the reference page
(docs/configuration.md) are all generated from them.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.scheduler.block_hash import HASH_ALGOS
from tandem.scheduler.policies import POLICIES
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.wire.config_fields import add_option, flags_of, hints, key_of, meta_of, option
from tandem.workers.config_checks import (
    check_engine_config,
)
from tandem.workers.graphs.sizes import (
    CUDA_GRAPH_MODES,
    DEFAULT_CUDA_GRAPH_MODE,
    check_cuda_graph_mode,
    parse_cuda_graph_sizes,
)

ENGINE_SECTIONS = {
    "model": "Engine: model and device",
    "cache": "Engine: KV cache",
    "scheduler": "Engine: scheduling",
    "parallel": "Engine: tensor parallelism and threads",
    "graphs": "Engine: CUDA graphs, torch.compile, prefill attention",
    "kv_transfer": "Engine: KV transfer and KV events",
    "offload": "Engine: KV offloading tiers (host memory, disk)",
    "output": "Engine: output backpressure",
    "identity": "Engine: set by the command",
    "hooks": "Engine: test hooks",
}


def _speculative_arg(text: str) -> dict[str, Any] | None:
    spec = SpeculativeConfig.from_dict(text)  # ValueError naming the field
    return spec.to_dict() if spec is not None else None


def _sizes_arg(text: str) -> list[int]:
    return parse_cuda_graph_sizes(text)


def _token_sizes_arg(text: str) -> list[int]:
    return parse_cuda_graph_sizes(text, "piecewise_graph_sizes")


@dataclass
class EngineConfig:
    """One engine's settings. Flat on purpose: ``config.block_size`` is read in
    dozens of places under ``workers/``; the sections (``ENGINE_SECTIONS``) are
    field metadata, and so are help, flag and whether a pool may differ
    (``per_pool``: P and D must agree on model, dtype, block size and KV layout)."""

    # ---- model and device
    model: str = option(
        "tiny",
        internal=True,
        section="model",
        help="'tiny', 'smollm2', a .gguf file, a local directory or a hub id "
        "(the command's --model)",
    )
    dtype: str = option("auto", section="model", help="auto | float32 | bfloat16 | float16")
    device: str = option("cpu", section="model", help="cpu or cuda")
    max_model_len: int | None = option(
        None,
        section="model",
        default_text="the model's context length, at most 4096",
        help="max prompt + output tokens",
    )
    seed: int = option(
        0,
        section="model",
        flag="--engine-seed",
        help="seed of the engine's sampler (the draws of requests that give no seed)",
    )
    # ---- KV cache
    block_size: int = option(16, section="cache", help="tokens per KV block")
    num_kv_blocks: int | None = option(
        None,
        section="cache",
        per_pool=True,
        default_text="sized from memory",
        help="KV blocks (wins over memory sizing)",
    )
    kv_cache_memory: int | None = option(
        None,
        section="cache",
        per_pool=True,
        default_text="1 GiB on CPU",
        help="bytes of KV cache (CPU)",
    )
    gpu_memory_utilization: float = option(
        0.9,
        section="cache",
        per_pool=True,
        help="fraction of GPU memory the engine sizes weights + activations + graphs + KV "
        "cache to (a pool sharing a GPU: 0.9 x its fraction, at most the fraction)",
    )
    enable_prefix_caching: bool = option(
        True,
        section="cache",
        per_pool=True,
        flag="--no-prefix-caching",
        help="reuse the KV of cached prompt prefixes (--no-prefix-caching: off)",
    )
    prefix_caching_hash_algo: str = option(
        "sha256",
        section="cache",
        per_pool=True,
        help=f"prefix-cache block hash: {' | '.join(HASH_ALGOS)}",
    )
    # byte layout of the KV cache (workers/runner/kv_cache.py): "head_major" makes a head slice of
    # a block one piece: cheaper KV reads between engines of different tensor-parallel sizes
    kv_layout: str = option(
        "blocks_first", section="cache", help="blocks_first | head_major (KV byte layout)"
    )
    # CPU fp32: the dense copy of decoding requests' KV (workers/runner/dense_decode.py)
    dense_decode_bytes: int | None = option(
        None,
        section="cache",
        per_pool=True,
        default_text="the runner's default",
        help="CPU dense decode KV copy in bytes (0 = off)",
    )
    # ---- KV offloading tiers below the device cache (kvtransfer/tiers/)
    kv_offloading_size: float | None = option(
        None, section="offload", per_pool=True, metavar="GiB",
        help="host-memory KV tier of each engine in GiB (pinned on CUDA); unset: none. "
        "Engines with it lend tier prefixes to each other over NIXL (prefill and decode "
        "engines; a colocated pool of more than one engine gets NIXL for it)",
    )  # fmt: skip
    kv_offloading_disk_dir: str | None = option(
        None, section="offload", per_pool=True, metavar="DIR",
        help="disk KV tier directory (one sub-directory per engine, kept across restarts)",
    )  # fmt: skip
    kv_offloading_disk_size: float | None = option(
        None, section="offload", per_pool=True, metavar="GiB",
        help="disk KV tier of each engine in GiB (with --kv-offloading-disk-dir)",
    )  # fmt: skip
    kv_offloading_disk_optional: bool = option(
        False, section="offload", per_pool=True,
        help="an unusable --kv-offloading-disk-dir (not writable, unreadable, another "
        "configuration's blocks) is a warning and host-only service, not a start-up error",
    )  # fmt: skip
    # ---- scheduling (scheduler/policies.py)
    max_num_seqs: int = option(
        128, section="scheduler", per_pool=True, help="max running requests per engine"
    )
    max_num_batched_tokens: int = option(
        2048, section="scheduler", per_pool=True, help="token budget per step"
    )
    enable_chunked_prefill: bool = option(
        True,
        section="scheduler",
        per_pool=True,
        flag="--no-chunked-prefill",
        help="split long prompts over steps (--no-chunked-prefill: off)",
    )
    long_prefill_token_threshold: int = option(
        0,
        section="scheduler",
        per_pool=True,
        help="prefill chunk cap; prompts with more tokens left are long (0 = none)",
    )
    policy: str = option(
        "fcfs",
        section="scheduler",
        per_pool=True,
        flag="--scheduling-policy",
        help=" | ".join(POLICIES),
    )
    kv_admission_margin: float = option(
        0.0,
        section="scheduler",
        per_pool=True,
        help="fraction of KV blocks kept free when admitting requests",
    )
    structured_outputs_compile_timeout_s: float = option(
        30.0,
        section="scheduler",
        per_pool=True,
        help="a constrained request whose grammar has not compiled by then ends in error",
    )
    max_num_partial_prefills: int = option(
        0, section="scheduler", per_pool=True, help="requests in prefill per step (0 = no limit)"
    )
    max_long_partial_prefills: int = option(
        0,
        section="scheduler",
        per_pool=True,
        help="long prefills per step (0 = no limit); shorter prompts overtake",
    )
    # overlap: schedule step N+1 while step N runs (workers/runner/async_step.py); outputs are
    # those of the synchronous loop. Tensor-parallel engines run synchronous steps.
    async_scheduling: bool | None = option(
        None,
        section="scheduler",
        per_pool=True,
        default_text="on with CUDA, off on CPU",
        help="schedule step N+1 while step N runs (same outputs as the synchronous loop)",
    )
    # speculative decoding (scheduler/spec/): vLLM's JSON shape; the decode pool of a P/D
    # cluster is the one that speculates (a prefill engine samples one token per request)
    speculative_config: dict[str, Any] | None = option(
        None,
        section="scheduler",
        per_pool=True,
        parse=_speculative_arg,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft_model", '
        '"model": "smollm2", "num_speculative_tokens": 4}\' (synchronous loop, TP 1)',
    )
    # ---- tensor parallelism (workers/parallel/)
    tensor_parallel_size: int = option(
        1,
        section="parallel",
        per_pool=True,
        short="-tp",
        help="workers per engine sharing its weights and KV heads (the model's head "
        "counts must split N ways)",
    )
    # the longest rank 0 waits for a worker within a step; a worker whose heartbeat stops
    # for half of it is reported as unresponsive (workers/parallel/heartbeat.py)
    tp_step_timeout_s: float = option(
        60.0,
        section="parallel",
        per_pool=True,
        help="TP: fail the engine when a worker is silent this long in a step",
    )
    # Pin it on shared machines: torch's default OpenMP threads stall badly when another
    # process uses the same cores.
    torch_threads: int = option(
        0,
        section="parallel",
        per_pool=True,
        default_text="0 (tandem serve on CPU: the cores split between engines)",
        help="CPU torch threads per engine (0 = torch's default)",
    )
    # ---- CUDA graphs (workers/graphs/; CPU ignores them), compile, prefill attention
    cuda_graph_mode: str = option(
        DEFAULT_CUDA_GRAPH_MODE,
        section="graphs",
        per_pool=True,
        parse=check_cuda_graph_mode,
        help=f"CUDA: {' | '.join(CUDA_GRAPH_MODES)}: steps that replay graphs",
    )
    cuda_graph_sizes: list[int] | None = option(
        None,
        section="graphs",
        per_pool=True,
        parse=_sizes_arg,
        default_text="1,2,4,8,16,32,... up to max_num_seqs",
        help="CUDA: decode batch sizes captured as graphs, e.g. 1,2,4,8",
    )
    piecewise_graph_sizes: list[int] | None = option(
        None,
        section="graphs",
        per_pool=True,
        parse=_token_sizes_arg,
        default_text="1,2,4,8,16,32,... up to min(512, max_num_batched_tokens)",
        help="CUDA: step token counts captured piecewise, e.g. 16,32,64",
    )
    enforce_eager: bool = option(
        False,
        section="graphs",
        per_pool=True,
        help="CUDA: no CUDA graphs (every step eager), whatever the mode",
    )
    prefill_attention: str = option(
        "auto",
        section="graphs",
        per_pool=True,
        help="auto | triton | sdpa: prefix-free prefills through torch SDPA or the paged "
        "Triton kernel (auto: the paged kernel)",
    )
    compile_model: str = option(
        "auto",
        section="graphs",
        per_pool=True,
        help="auto | on | off: torch.compile the model's forward at start-up (auto: eager)",
    )
    # ---- KV transfer (kvtransfer/) and KV events (scheduler/kv_events.py)
    kv_transport_probe: str = option(
        "auto",
        section="kv_transfer",
        per_pool=True,
        help="auto | on | off: a start-up READ reports UCX's transport (auto: on with CUDA)",
    )
    engine_id: str = option("engine-0", section="identity", internal=True, help="engine id")
    epoch: int = option(0, section="identity", internal=True, help="restart count")
    role: str = option(
        "colocated", section="identity", internal=True, help="prefill | decode | colocated"
    )
    kv_connector: str | None = option(
        None, section="identity", internal=True, help='"nixl" to exchange KV with peers'
    )
    kv_borrows_tiers: bool = option(
        False,
        section="identity",
        internal=True,
        help="a prefill engine without a host KV tier reads peers' (another pool keeps one)",
    )
    kv_host: str = option(
        "127.0.0.1", section="identity", internal=True, help="side-channel host peers connect to"
    )
    kv_port: int = option(
        0, section="kv_transfer", help="KV side-channel port of each engine (0 = a free port)"
    )
    kv_lease_s: float = option(
        60.0,
        section="kv_transfer",
        help="how long a prefill engine holds a request's KV for the decode engine",
    )
    kv_load_timeout_s: float = option(
        30.0, section="kv_transfer", help="a decode engine gives up one KV load after this long"
    )
    load_failure_policy: str = option(
        "recompute",
        section="kv_transfer",
        choices=("recompute", "fail"),
        help="a failed KV load: recompute the missing blocks on decode, or fail the request",
    )
    # Per-cluster secret of the internal planes (engine sockets, KV side channel): CURVE
    # keys are derived from it (wire/auth.py). None = plain ZMQ, the development mode of
    # in-process engines; ``tandem serve`` always sets one. Never printed.
    cluster_secret: bytes | None = option(
        None, repr=False, section="identity", internal=True, help="internal planes' secret"
    )
    # ---- output backpressure (workers/engine/output_sender.py)
    output_hwm_messages: int = option(
        1000, section="output", per_pool=True, help="ZMQ send queue to the gateway"
    )
    output_backlog_messages: int = option(
        64, section="output", per_pool=True, help="outputs held before pausing"
    )
    output_stall_timeout_s: float = option(
        60.0,
        section="output",
        per_pool=True,
        help="cut streams when the gateway reads nothing this long",
    )
    profile_dir: str | None = option(
        None,
        section="output",
        default_text="off (POST /start_profile answers 400)",
        help="directory for the engines' torch profiler traces (POST /start_profile, "
        "/stop_profile)",
    )
    gateway_lost_after_s: float = option(
        10.0,
        section="output",
        per_pool=True,
        help="drop a gateway (aborting its requests) whose output connection is down this long",
    )
    # KV events for KV-aware routing: on when the router needs them; ZMQ PUB on
    # kv_host:kv_events_port, at most kv_events_queue_batches batches waiting
    kv_events: bool = option(
        False, section="identity", internal=True, help="publish KV events (kv-aware routing)"
    )
    kv_events_port: int = option(
        0, section="kv_transfer", help="KV events PUB port of each engine (0 = a free port)"
    )
    kv_events_queue_batches: int = option(
        1024, section="kv_transfer", help="KV event batches waiting to be sent, at most"
    )
    # applied by the Ray actor (cluster/observability/logging_setup.py)
    log_format: str = option(
        "text", section="identity", internal=True, help="engine log lines: text | json"
    )
    extra: dict[str, Any] = option(
        default_factory=dict,
        section="hooks",
        per_pool=True,
        yaml_only=True,
        help="test hooks, passed to the engine as is",
    )

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

    def uses_async_scheduling(self) -> bool:
        """Whether the overlapped loop runs (before the tensor-parallel exception). Auto turns
        it on for CUDA: on an H200 (2026-11-26, ``benchmarks/gpu_engine.py``, the 1B-shaped
        bf16 Llama) it cut the decode step at batch 1/64/256 from 1.60/2.55/6.04 ms to
        1.25/1.82/4.49 ms. On CPU the step thread's gain is smaller than its noise
        (``benchmarks/async_scheduling.py``), so auto stays synchronous there."""
        if self.async_scheduling is None:
            return self.device.startswith("cuda")
        return self.async_scheduling

    def __post_init__(self) -> None:
        check_engine_config(self)  # ValueError naming the field (workers/config_checks.py)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# ---- the engine flags (tandem generate, tandem serve) --------------------------------


def engine_fields(internal: bool = False) -> list[dataclasses.Field]:
    """EngineConfig's settings in declaration order (``internal``: also those the
    command sets itself)."""
    return [
        f
        for f in dataclasses.fields(EngineConfig)
        if internal or not meta_of(EngineConfig, f).internal
    ]


# Pool variants (--decode-device) of settings that are one for every pool: they
# were flags before the pools knew better, so they stay, hidden; tandem serve
# warns and still applies them to that pool.
HIDDEN_POOL_FLAGS = ("dtype", "device", "block_size", "max_model_len", "kv_layout")


def add_engine_arguments(
    parser: argparse.ArgumentParser | Any,
    prefix: str = "",
    exclude: tuple[str, ...] = (),
) -> None:
    """The engine flags, one argument group per section (``exclude``: field
    names left out). ``prefix`` ("decode-") adds a pool's variants into
    ``parser`` (a parser or a group): ``--decode-X`` for the fields that may
    differ per pool, hidden ones for ``HIDDEN_POOL_FLAGS``."""
    groups: dict[str, Any] = {}
    hint_of = hints(EngineConfig)
    for f in engine_fields():
        meta = meta_of(EngineConfig, f)
        if meta.yaml_only or f.name in exclude:
            continue
        if prefix and not (meta.per_pool or f.name in HIDDEN_POOL_FLAGS):
            continue
        if prefix:
            container = parser
        else:
            if meta.section not in groups:
                groups[meta.section] = (
                    parser.add_argument_group(ENGINE_SECTIONS[meta.section])
                    if hasattr(parser, "add_argument_group")
                    else parser
                )
            container = groups[meta.section]
        default = f.default if f.default is not dataclasses.MISSING else None
        role = prefix.rstrip("-")
        add_option(
            container,
            key=key_of(EngineConfig, f),
            meta=meta,
            hint=hint_of[f.name],
            default=default,
            dest=prefix.replace("-", "_") + f.name,
            prefix=prefix,
            help=(f"the {role} pool's {main_flags(f.name)}" if prefix else None),
            hidden=bool(prefix) and not meta.per_pool,
            show_default=not prefix,
        )


def main_flags(name: str) -> str:
    """The flag(s) of one engine field: ``--block-size``, ``--async-scheduling /
    --no-async-scheduling``."""
    f = EngineConfig.__dataclass_fields__[name]
    meta = meta_of(EngineConfig, f)
    default = f.default if f.default is not dataclasses.MISSING else None
    flags = flags_of(key_of(EngineConfig, f), meta, default, hints(EngineConfig)[name])
    return " / ".join(flag for flag, _ in flags)


def engine_overrides(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """Fields the user set on the command line (None = not given)."""
    p = prefix.replace("-", "_")
    out = {}
    for f in engine_fields():
        v = getattr(args, p + f.name, None)
        if v is not None:
            out[f.name] = v
    return out
