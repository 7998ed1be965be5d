"""Decode CUDA graphs: capture the model's forward once per batch-size bucket, replay per step.

A decode step launches a few hundred small kernels whose host-side enqueue time exceeds their
GPU time; a replayed graph enqueues them all at once. Flow of a step (model runner)::

    decode-only batch of n, bucket b = smallest captured size >= n ?
      yes: StaticDecodeInputs.fill (host, pinned) -> non_blocking H2D copies
           -> replay graph[b] -> hidden[:n] (a view of the graph's static output)
      no (a prefill or chunk in the step, n > largest bucket, --enforce-eager):
           piecewise graphs when the mode has them (piecewise.py), else the eager path
    then logits + sampling outside the graph; the sampled tokens' .tolist() is the step's one
    device->host sync

Capture happens at engine start-up, largest bucket first, every graph in one memory pool (they
never run concurrently; each one's output tensor stays referenced so no later capture reuses
it), with one log line giving the time and memory it took. ``GraphBackend`` is the seam: CUDA
captures a ``torch.cuda.CUDAGraph``; ``EagerBackend`` re-runs the same function over the same
static buffers, which is how the CPU tests check everything except the capture itself.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tandem.workers.graphs.sizes import bucket_for
from tandem.workers.graphs.static_inputs import StaticDecodeInputs

logger = logging.getLogger(__name__)

# Runs before each capture: Triton compiles, cuBLAS picks its kernels, lazy buffers get made.
NUM_WARMUP_RUNS = 2

# cudaStreamCaptureMode of every capture. Under torch's default, "global", a potentially unsafe
# CUDA call (event query, cudaMalloc, ...) by ANY thread of the process while a capture is open
# fails and invalidates the capture; this process has other threads that may touch CUDA: NIXL's
# C++ progress thread and the connector's ProgressPoller (UCX's cuda_ipc / cuda_copy transports
# query events and copy on their own streams). "thread_local" still rejects unsafe calls by the
# capturing thread (a real capture bug) and lets other threads' work on their own streams go on.
# What no mode allows, a device-wide sync (cudaDeviceSynchronize, torch.cuda.empty_cache) by
# another thread mid-capture, no thread of an engine does. The poller need not pause either:
# captures run in EngineCore.__init__ before the runner registers the KV cache with the
# connector (which starts the UCX transport probe's READ, kvtransfer/ucx/probe.py) and before
# any request, so the poller is idle (it polls only while this engine holds blocks for a
# decode engine) and no transfer is in flight. See docs/architecture.md.
CAPTURE_ERROR_MODE = "thread_local"


class GraphBackend(Protocol):
    def capture(self, forward: Callable[[], Any]) -> Callable[[], Any]:
        """Record ``forward`` (reads only static buffers); return a replay that re-runs it
        and returns its output (the same tensor every time for a real graph; None for a
        piece that writes its results into static buffers)."""
        ...


class EagerBackend:
    """Replay = call ``forward`` again: the graph runner without CUDA (CPU tests)."""

    def capture(self, forward: Callable[[], Any]) -> Callable[[], Any]:
        return forward


_CAPTURE_STREAMS: dict[torch.device, Any] = {}


def capture_stream(device: torch.device) -> Any:
    """The one side stream every warm-up and capture on ``device`` runs on. cuBLAS keeps a
    workspace per stream it ran on, so a fresh stream per graph would leave one behind per
    pool stream; one stream leaves one, shared by the profiling and the real capture."""
    device = torch.device(device)
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` per bucket, all in one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = capture_stream(device)
        self.pool: Any = None
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, forward: Callable[[], Any]) -> Callable[[], Any]:
        side, current = self.stream, torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_RUNS):
                forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self.pool, stream=side, capture_error_mode=CAPTURE_ERROR_MODE
        ):
            output = forward()
        current.wait_stream(side)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs.append(graph)

        def replay() -> Any:
            graph.replay()
            return output

        return replay

    def release(self) -> None:
        """Destroy every graph and drop the pool (after a memory-profiling capture); the
        memory returns to the device at the caller's ``torch.cuda.empty_cache()``."""
        for graph in self.graphs:
            graph.reset()
        self.graphs.clear()
        self.pool = None


@dataclass
class CaptureReport:
    sizes: list[int]
    seconds: float
    num_bytes: int  # device memory the graphs took (0 off CUDA)


@dataclass
class DecodeGraphRunner:
    """Captured decode forwards per bucket; ``run`` replays one or returns None (go eager)."""

    model: torch.nn.Module
    kv_cache: torch.Tensor
    block_size: int
    max_model_len: int
    sizes: list[int]
    backend: GraphBackend
    inputs: StaticDecodeInputs = field(init=False)
    replays: dict[int, Callable[[], torch.Tensor]] = field(init=False, default_factory=dict)
    num_replays: dict[int, int] = field(init=False, default_factory=dict)
    # a speculative engine's drafted steps (several query tokens per sequence): verify.py
    verify: Any = None

    def __post_init__(self) -> None:
        self.sizes = sorted(self.sizes)
        num_slots = self.kv_cache.shape[0] * self.block_size
        if num_slots >= 2**31:
            raise ValueError(f"{num_slots} KV slots do not fit the graphs' int32 slot buffer")
        max_blocks = math.ceil(self.max_model_len / self.block_size)
        self.inputs = StaticDecodeInputs(
            self.sizes[-1], max_blocks, self.block_size, self.kv_cache.device
        )

    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.sizes)

    @torch.inference_mode()
    def capture(self, log: bool = True) -> CaptureReport:
        """Capture every bucket, largest first, over all-padding inputs (nothing is written
        to the KV cache: every slot is -1)."""

        def capture_all() -> None:
            for size in reversed(self.sizes):
                self.inputs.fill([], [], [], [], size)
                self.replays[size] = self.backend.capture(self._forward_fn(size))
                self.num_replays[size] = 0
            if self.verify is not None:
                self.verify.capture()

        seconds, num_bytes = timed_capture(self.kv_cache.device, capture_all)
        report = CaptureReport(list(self.sizes), seconds, num_bytes)
        if log:
            logger.info(
                "captured %d decode graphs (batch sizes %s)%s in %.2f s, %.1f MiB of device memory",
                len(report.sizes),
                _compact(report.sizes),
                ""
                if self.verify is None
                else f" and {len(self.verify.sizes)} verification graphs (tokens "
                f"{_compact(self.verify.sizes)}, queries <= {self.verify.query_tokens})",
                report.seconds,
                report.num_bytes / 2**20,
            )
        return report

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        meta = self.inputs.metadata(size)
        return static_forward(self.model, self.kv_cache, self.inputs, meta, size)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        patch_ids: Callable[[torch.Tensor], None] | None = None,
        query_lens: list[int] | None = None,
    ) -> torch.Tensor | None:
        """Hidden states ``[n, hidden]`` of a decode-only batch by replay, or None when the
        step must run eager (some sequence has more than one query token, or no bucket is
        big enough). The result is a view of the graph's output: read it before the next
        ``run``. ``patch_ids`` gets the device input ids ``[n]`` before the replay (the
        overlapped loop writes the previous step's sampled tokens into them). With
        verification graphs (``verify``) and ``query_lens``, a step of several query tokens
        per sequence (drafts) replays one of those instead (``verify.py``)."""
        n = len(seq_lens)
        if n and len(input_ids) != n and self.verify is not None and query_lens is not None:
            return self.verify.run(
                input_ids, positions, block_tables, seq_lens, query_lens, patch_ids
            )
        if n == 0 or len(input_ids) != n:
            return None
        size = self.bucket_for(n)
        if size is None or size not in self.replays:
            return None
        self.inputs.fill(input_ids, positions, block_tables, seq_lens, size)
        if patch_ids is not None:
            patch_ids(self.inputs.device_view("input_ids", n))
        self.num_replays[size] += 1
        return self.replays[size]()[:n]


def static_forward(
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    inputs: StaticDecodeInputs,
    meta: Any,
    num_tokens: int,
) -> Callable[[], torch.Tensor]:
    """The forward a full graph captures: ``model`` over the first ``num_tokens`` rows of
    ``inputs``' static ids and positions, with ``meta`` (a bucket's metadata over the same
    buffers)."""
    ids = inputs.device_view("input_ids", num_tokens)
    positions = inputs.device_view("positions", num_tokens)

    def forward() -> torch.Tensor:
        return model(ids, positions, kv_cache, meta)

    return forward


def graphs_allowed(config: Any, device: torch.device) -> bool:
    """CUDA graphs of any kind: only on CUDA, without ``enforce_eager``, and on one GPU (a
    rank-0 capture would issue collectives the other ranks never join; TP engines run eager)."""
    if device.type != "cuda" or config.graphs.enforce_eager:
        return False
    if config.parallel.tensor_parallel_size > 1:
        logger.info("tensor-parallel engine: CUDA graphs off (eager steps)")
        return False
    return True


# What a capture may take outside torch's allocator (the driver's executable graphs).
DRIVER_GRAPH_BYTES = 512 << 20


def timed_capture(device: torch.device, capture: Callable[[], None]) -> tuple[float, int]:
    """Run ``capture``; return its seconds and the device memory it took (free memory before
    minus after, so graph pools and the driver's graph objects both count; 0 off CUDA).

    Free memory is device-wide: on a GPU shared with other engines (``--num-gpus-per-engine
    0.5``, started together) it also drops by what they allocate meanwhile, e.g. a whole KV
    cache, which this engine would then take out of its own budget. So the result is capped
    at this process's torch reservation growth plus ``DRIVER_GRAPH_BYTES``.

    The warm-up runs' activations come from torch's ordinary cache, not the graphs' pool;
    they are handed back before measuring, so they are not counted twice (the profiled
    activation peak covers them)."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        reserved_before = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    capture()
    num_bytes = 0
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        device_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        own_bytes = max(0, torch.cuda.memory_reserved(device) - reserved_before)
        num_bytes = min(device_bytes, own_bytes + DRIVER_GRAPH_BYTES)
    return time.perf_counter() - start, num_bytes


def _compact(sizes: list[int]) -> str:
    return ",".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]}"
