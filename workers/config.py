"""Engine configuration: one typed place for every engine flag.

The same fields are the flags of ``tandem generate`` and ``tandem serve``
(``--block-size`` ... ``--no-prefix-caching``); ``add_engine_arguments`` and
``EngineConfig.from_args`` keep the two in step. Per-pool overrides in
``tandem serve`` use the same names with a ``--prefill-`` / ``--decode-``
prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from scheduler.block_hash import HASH_ALGOS, get_block_hasher
from scheduler.policies import POLICIES, check_fields
from workers.graphs.sizes import (
    CUDA_GRAPH_MODES,
    DEFAULT_CUDA_GRAPH_MODE,
    capture_sizes,
    check_cuda_graph_mode,
    parse_cuda_graph_sizes,
    piecewise_sizes,
)

# EngineConfig.prefill_attention (kernels/prefill_attention.py)
PREFILL_ATTENTION_MODES = ("auto", "triton", "sdpa")
# EngineConfig.compile_model (workers/compile/)
COMPILE_MODEL_MODES = ("auto", "on", "off")


@dataclass
class EngineConfig:
    model: str = "tiny"
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context length, capped at 4096
    num_kv_blocks: int | None = None  # explicit block count; wins over memory sizing
    kv_cache_memory: int | None = None  # bytes for the KV cache (CPU); default 1 GiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # sha256 | xxhash128 | builtin
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # fcfs | priority | prefill-first (scheduler/policies.py)
    kv_admission_margin: float = 0.0  # fraction of KV blocks kept free at admission
    max_num_partial_prefills: int = 0  # per step, 0 = no limit
    max_long_partial_prefills: int = 0  # per step, 0 = no limit
    seed: int = 0
    # workers per engine, each holding 1/N of the weights and KV heads
    # (workers/parallel/); the model's head counts must split N ways
    tensor_parallel_size: int = 1
    # TP > 1: the longest rank 0 waits for a worker within a step (a
    # collective, a reply) before the engine fails naming the rank; a worker
    # whose heartbeat stops for half of it is reported as unresponsive
    # (workers/parallel/heartbeat.py)
    tp_step_timeout_s: float = 60.0
    # CPU: torch intra-op threads (0 = torch's default). Pin it on shared
    # machines: torch's default OpenMP threads stall badly when another
    # process uses the same cores.
    torch_threads: int = 0
    # CPU fp32: bytes for the dense copy of decoding requests' KV (None =
    # workers.runner.model_runner default, 0 = off); see workers/runner/dense_decode.py.
    dense_decode_bytes: int | None = None
    # byte layout of the KV cache (workers/runner/kv_cache.py): "blocks_first" or
    # "head_major" (a head slice of a block is one piece: cheaper KV reads
    # between engines of different tensor-parallel sizes). P and D must agree.
    kv_layout: str = "blocks_first"
    # CUDA graphs (workers/graphs/; CPU ignores all four): which steps replay graphs
    # (decode | piecewise | full_and_piecewise | none, workers/graphs/sizes.py), the decode
    # batch sizes captured whole (None = 1, 2, 4, 8, 16, then every 16 up to max_num_seqs),
    # the step token counts captured piecewise (None = 1, 2, 4, 8, then every 16 up to
    # min(512, max_num_batched_tokens)); enforce_eager captures none, whatever the mode.
    cuda_graph_mode: str = DEFAULT_CUDA_GRAPH_MODE
    cuda_graph_sizes: list[int] | None = None
    piecewise_graph_sizes: list[int] | None = None
    enforce_eager: bool = False
    # how prefix-free prefills (query = whole context) attend (kernels/prefill_attention.py):
    # auto (SDPA on CUDA in fp16/bf16, else the paged kernel) | triton (always paged) | sdpa
    prefill_attention: str = "auto"
    # overlap: schedule step N+1 while step N runs (workers/runner/async_step.py); outputs are
    # those of the synchronous loop. Tensor-parallel engines run synchronous steps.
    # None = auto: on for CUDA engines (`uses_async_scheduling`), off on CPU.
    async_scheduling: bool | None = None
    # torch.compile the model's forward at start-up (workers/compile/): auto (eager: see
    # workers/compile/model.py use_compile for why) | on | off
    compile_model: str = "auto"
    # start-up probe READ reporting UCX's transport (kvtransfer/ucx/probe.py):
    # auto (on with CUDA) | on | off
    kv_transport_probe: str = "auto"
    # identity and disaggregation
    engine_id: str = "engine-0"
    epoch: int = 0
    role: str = "colocated"  # "prefill" | "decode" | "colocated"
    kv_connector: str | None = None  # "nixl" to exchange KV with peers
    kv_host: str = "127.0.0.1"  # side-channel host peers connect to
    kv_port: int = 0  # 0: pick a free port
    kv_lease_s: float = 60.0
    kv_load_timeout_s: float = 30.0
    load_failure_policy: str = "recompute"
    # Per-cluster secret of the internal planes (engine sockets, KV side
    # channel): CURVE keys are derived from it (wire/auth.py). None = plain
    # ZMQ, the development mode of in-process engines; ``tandem serve`` always
    # sets one. Never printed.
    cluster_secret: bytes | None = field(default=None, repr=False)
    # output backpressure (workers/engine/output_sender.py): ZMQ send queue of the
    # output socket, the local backlog behind it, and how long the gateway
    # may read nothing before every stream is cut with an error
    output_hwm_messages: int = 1000
    output_backlog_messages: int = 64
    output_stall_timeout_s: float = 60.0
    # KV events for KV-aware routing (scheduler/kv_events.py): off unless the
    # router needs them; ZMQ PUB on kv_host:kv_events_port (0 = a free port),
    # at most kv_events_queue_batches batches waiting to be sent
    kv_events: bool = False
    kv_events_port: int = 0
    kv_events_queue_batches: int = 1024
    # log lines of the engine's process: "text" or "json" (cluster/observability/logging_setup.py,
    # applied by the Ray actor); `tandem serve --log-format` sets it for every pool
    log_format: str = "text"
    extra: dict[str, Any] = field(default_factory=dict)

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
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("output_hwm_messages", "output_backlog_messages", "kv_events_queue_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.output_stall_timeout_s > 0:
            raise ValueError(
                f"output_stall_timeout_s must be > 0, got {self.output_stall_timeout_s}"
            )
        if isinstance(self.tensor_parallel_size, bool) or not (
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1
        ):
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if not self.tp_step_timeout_s > 0:
            raise ValueError(f"tp_step_timeout_s must be > 0, got {self.tp_step_timeout_s}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        get_block_hasher(self.prefix_caching_hash_algo)  # ValueError naming the field
        capture_sizes(self.max_num_seqs, self.cuda_graph_sizes)  # names cuda_graph_sizes
        self.cuda_graph_mode = check_cuda_graph_mode(self.cuda_graph_mode)
        piecewise_sizes(self.max_num_batched_tokens, self.piecewise_graph_sizes)
        check_fields(self)  # policy, admission margin, partial prefill limits
        if self.prefill_attention not in PREFILL_ATTENTION_MODES:
            raise ValueError(
                f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION_MODES)}, "
                f"got {self.prefill_attention!r}"
            )
        if self.compile_model not in COMPILE_MODEL_MODES:
            raise ValueError(
                f"compile_model must be one of {', '.join(COMPILE_MODEL_MODES)}, "
                f"got {self.compile_model!r}"
            )
        if self.compile_model == "on" and self.tensor_parallel_size > 1:
            raise ValueError("compile_model 'on' needs tensor_parallel_size 1")
        if self.kv_transport_probe not in ("auto", "on", "off"):
            raise ValueError(
                f"kv_transport_probe must be auto, on or off, got {self.kv_transport_probe!r}"
            )
        if self.kv_layout not in ("blocks_first", "head_major"):
            raise ValueError(
                f"kv_layout must be blocks_first or head_major, got {self.kv_layout!r}"
            )
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role must be prefill, decode or colocated, got {self.role!r}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"load_failure_policy must be recompute or fail, got {self.load_failure_policy!r}"
            )

        from wire.auth import check_secret

        check_secret(self.cluster_secret, "EngineConfig.cluster_secret")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def _sizes_arg(text: str) -> list[int]:
    try:
        return parse_cuda_graph_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _token_sizes_arg(text: str) -> list[int]:
    try:
        return parse_cuda_graph_sizes(text, "piecewise_graph_sizes")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mode_arg(text: str) -> str:
    try:
        return check_cuda_graph_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# flag name -> (field, type, help). Booleans that default to on get --no-X.
_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--dtype", "dtype", str, "auto|float32|bfloat16|float16"),
    ("--device", "device", str, "cpu or cuda"),
    ("--block-size", "block_size", int, "tokens per KV block"),
    ("--max-num-seqs", "max_num_seqs", int, "max running requests per engine"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget per step"),
    ("--max-model-len", "max_model_len", int, "max prompt + output tokens"),
    ("--num-kv-blocks", "num_kv_blocks", int, "KV blocks (overrides memory sizing)"),
    ("--kv-cache-memory", "kv_cache_memory", int, "bytes of KV cache (CPU)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "fraction of GPU memory"),
    (
        "--long-prefill-token-threshold",
        "long_prefill_token_threshold",
        int,
        "prefill chunk cap; prompts with more tokens left are long",
    ),
    ("--scheduling-policy", "policy", str, " | ".join(POLICIES) + " (default fcfs)"),
    (
        "--kv-admission-margin",
        "kv_admission_margin",
        float,
        "fraction of KV blocks kept free when admitting requests (default 0)",
    ),
    (
        "--max-num-partial-prefills",
        "max_num_partial_prefills",
        int,
        "requests in prefill per step (0 = no limit)",
    ),
    (
        "--max-long-partial-prefills",
        "max_long_partial_prefills",
        int,
        "long prefills per step (0 = no limit); shorter prompts overtake",
    ),
    (
        "--prefix-caching-hash-algo",
        "prefix_caching_hash_algo",
        str,
        f"prefix-cache block hash: {' | '.join(HASH_ALGOS)} (default sha256)",
    ),
    (
        "--tensor-parallel-size",
        "tensor_parallel_size",
        int,
        "workers per engine sharing its weights and KV heads (-tp; default 1)",
    ),
    (
        "--tp-step-timeout-s",
        "tp_step_timeout_s",
        float,
        "TP: fail the engine when a worker is silent this long in a step (default 60)",
    ),
    ("--torch-threads", "torch_threads", int, "CPU threads per engine (0 = torch default)"),
    ("--dense-decode-bytes", "dense_decode_bytes", int, "CPU dense decode KV copy (0 = off)"),
    ("--kv-layout", "kv_layout", str, "blocks_first | head_major (KV byte layout)"),
    (
        "--cuda-graph-sizes",
        "cuda_graph_sizes",
        _sizes_arg,
        "CUDA: decode batch sizes to capture as graphs, e.g. 1,2,4,8 "
        "(default 1,2,4,8,16,32,... up to --max-num-seqs)",
    ),
    (
        "--prefill-attention",
        "prefill_attention",
        str,
        "auto | triton | sdpa: prefix-free prefills through torch SDPA (auto: CUDA fp16/bf16) "
        "or the paged Triton kernel",
    ),
    (
        "--cuda-graph-mode",
        "cuda_graph_mode",
        _mode_arg,
        f"CUDA: {' | '.join(CUDA_GRAPH_MODES)}: steps that replay graphs "
        f"(default {DEFAULT_CUDA_GRAPH_MODE}: decode-only batches)",
    ),
    (
        "--piecewise-graph-sizes",
        "piecewise_graph_sizes",
        _token_sizes_arg,
        "CUDA: step token counts captured piecewise, e.g. 16,32,64 "
        "(default 1,2,4,8,16,32,... up to min(512, --max-num-batched-tokens))",
    ),
    (
        "--compile-model",
        "compile_model",
        str,
        "auto | on | off: torch.compile the model's forward at start-up (auto: eager)",
    ),
    (
        "--kv-transport-probe",
        "kv_transport_probe",
        str,
        "auto | on | off: a start-up READ reports UCX's transport (auto: on with CUDA)",
    ),
    ("--output-hwm-messages", "output_hwm_messages", int, "ZMQ send queue to the gateway"),
    ("--output-backlog-messages", "output_backlog_messages", int, "outputs held before pausing"),
    (
        "--output-stall-timeout-s",
        "output_stall_timeout_s",
        float,
        "cut streams when the gateway reads nothing this long",
    ),
]
# short aliases of the unprefixed flags
_SHORT_FLAGS = {"--tensor-parallel-size": "-tp"}
_BOOL_OFF_FLAGS = [
    ("--no-prefix-caching", "enable_prefix_caching"),
    ("--no-chunked-prefill", "enable_chunked_prefill"),
    ("--no-async-scheduling", "async_scheduling"),
]
# Booleans that default to off get --X (store_true).
_BOOL_ON_FLAGS = [
    ("--enforce-eager", "enforce_eager", "CUDA: no CUDA graphs (every step eager)"),
    (
        "--async-scheduling",
        "async_scheduling",
        "schedule step N+1 while step N runs (same outputs as the synchronous loop); "
        "default: on with CUDA, off on CPU (--no-async-scheduling turns it off)",
    ),
]


def add_engine_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """Engine flags; ``prefix`` ("prefill-") makes per-pool variants that default to None."""
    for flag, dest, typ, help_ in _FLAGS:
        names = ["--" + prefix + flag[2:]]
        if not prefix and flag in _SHORT_FLAGS:
            names.append(_SHORT_FLAGS[flag])
        parser.add_argument(*names, dest=prefix.replace("-", "_") + dest, type=typ, help=help_)
    for flag, dest in _BOOL_OFF_FLAGS:
        name = "--" + prefix + flag[2:]
        parser.add_argument(
            name, dest=prefix.replace("-", "_") + dest, action="store_false", default=None
        )
    for flag, dest, help_ in _BOOL_ON_FLAGS:
        name = "--" + prefix + flag[2:]
        parser.add_argument(
            name, dest=prefix.replace("-", "_") + dest, action="store_true", default=None,
            help=help_,
        )  # fmt: skip


def engine_overrides(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """Fields the user set on the command line (None = not given)."""
    out = {}
    p = prefix.replace("-", "_")
    for _, dest, _, _ in _FLAGS:
        v = getattr(args, p + dest, None)
        if v is not None:
            out[dest] = v
    for _, dest in _BOOL_OFF_FLAGS:
        v = getattr(args, p + dest, None)
        if v is not None:
            out[dest] = v
    for _, dest, _ in _BOOL_ON_FLAGS:
        v = getattr(args, p + dest, None)
        if v is not None:
            out[dest] = v
    return out
