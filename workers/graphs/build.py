"""The engine's CUDA graphs, by ``--cuda-graph-mode``: full decode graphs, piecewise graphs,
both, or none (``sizes.py`` lists the modes).

``build_step_graphs`` is what ``EngineCore`` calls once its KV cache exists (the graphs bake in
the cache's address). Both kinds share one memory pool: they never run at once, a decode
graph's output is read before the next replay, and a piece keeps nothing in the pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kernels.prefill_attention import use_sdpa_prefills
from tandem.workers.graphs.piecewise import PiecewiseGraphRunner
from tandem.workers.graphs.runner import (
    CudaGraphBackend,
    DecodeGraphRunner,
    GraphBackend,
    graphs_allowed,
    timed_capture,
)
from tandem.workers.graphs.sizes import (
    capture_sizes,
    piecewise_sizes,
    uses_full_decode,
    uses_piecewise,
)
from tandem.workers.graphs.verify import VerifyGraphRunner

logger = logging.getLogger(__name__)

# Device memory is measured in whole pages and segments: differences below this are noise.
GRAPH_BYTES_SLACK = 4 << 20


@dataclass
class StepGraphs:
    """What the model runner replays: full decode graphs first, then piecewise, else eager."""

    decode: DecodeGraphRunner | None = None
    piecewise: PiecewiseGraphRunner | None = None
    num_bytes: int = 0  # device memory the captures took (0 off CUDA or before capture)
    seconds: float = 0.0

    def capture(self, log: bool = True) -> StepGraphs:
        for runner in (self.decode, self.piecewise):
            if runner is not None:
                report = runner.capture(log)
                self.num_bytes += report.num_bytes
                self.seconds += report.seconds
        return self


def make_step_graphs(
    config: Any,
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    max_model_len: int,
    backend: GraphBackend,
    full_only: bool = False,
) -> StepGraphs:
    """The runners ``config.graphs.cuda_graph_mode`` asks for, not yet captured, on ``backend``
    (any device: the CPU tests pass ``EagerBackend``). ``config``: an ``EngineConfig``.
    ``full_only``: the full graphs alone (decode and verification), no piecewise ones."""
    mode = "none" if config.graphs.enforce_eager else config.graphs.cuda_graph_mode
    graphs = StepGraphs()
    if uses_full_decode(mode):
        sizes = capture_sizes(config.scheduler.max_num_seqs, config.graphs.cuda_graph_sizes)
        graphs.decode = DecodeGraphRunner(
            model, kv_cache, config.cache.block_size, max_model_len, sizes, backend
        )
        spec = config.speculative()
        if spec is not None:  # drafted steps: verification graphs (verify.py)
            graphs.decode.verify = VerifyGraphRunner(
                model,
                kv_cache,
                config.cache.block_size,
                max_model_len,
                sizes,
                spec.num_speculative_tokens + 1,
                backend,
            )
    if uses_piecewise(mode) and not full_only:
        sizes = piecewise_sizes(
            config.scheduler.max_num_batched_tokens, config.graphs.piecewise_graph_sizes
        )
        graphs.piecewise = PiecewiseGraphRunner(
            model,
            kv_cache,
            config.cache.block_size,
            sizes,
            backend,
            sdpa_prefills=use_sdpa_prefills(
                config.graphs.prefill_attention, kv_cache.device, kv_cache.dtype
            ),
        )
    return graphs


def capture_step_graphs(
    config: Any,
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    max_model_len: int,
    backend: GraphBackend,
    log: bool = True,
    full_only: bool = False,
) -> StepGraphs:
    """``make_step_graphs`` and capture, measured as one: ``num_bytes`` is what the device
    lost over both (``timed_capture``), so the runners' static buffers count as the caching
    allocator reserved them (a 2 MiB buffer can take a 20 MiB segment), not by their tensor
    sizes. The memory profile (``memory.py``) and the engine's real capture measure through
    this one function, so the profiled figure and the real one compare like with like."""
    made: list[StepGraphs] = []

    def make_and_capture() -> None:
        graphs = make_step_graphs(config, model, kv_cache, max_model_len, backend, full_only)
        made.append(graphs.capture(log))

    _, num_bytes = timed_capture(kv_cache.device, make_and_capture)
    graphs = made[0]
    if kv_cache.device.type == "cuda":
        graphs.num_bytes = num_bytes
    return graphs


def build_step_graphs(
    config: Any,
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    max_model_len: int,
    profiled_bytes: int | None = None,
) -> StepGraphs:
    """The engine's graphs, captured; empty on CPU, with ``enforce_eager`` or
    ``cuda_graph_mode`` none, or with tensor parallelism (``graphs_allowed``).

    ``profiled_bytes``: what the profiling capture measured and the KV budget left for the
    graphs (``workers/graphs/memory.py``); a warning names any excess of the real capture."""
    if not graphs_allowed(config, kv_cache.device):
        return StepGraphs()
    backend = CudaGraphBackend(kv_cache.device)
    graphs = capture_step_graphs(config, model, kv_cache, max_model_len, backend)
    mib = 2**20
    if profiled_bytes and graphs.num_bytes > profiled_bytes + GRAPH_BYTES_SLACK:
        logger.warning(
            "CUDA graphs took %.1f MiB, %.1f MiB more than the profiled %.1f MiB the KV "
            "budget left for them: the engine may exceed --gpu-memory-utilization by that much",
            graphs.num_bytes / mib,
            (graphs.num_bytes - profiled_bytes) / mib,
            profiled_bytes / mib,
        )
    elif profiled_bytes:
        logger.info(
            "CUDA graphs: %.1f MiB in %.2f s (profiled before sizing the KV cache: %.1f MiB)",
            graphs.num_bytes / mib,
            graphs.seconds,
            profiled_bytes / mib,
        )
    return graphs


def build_draft_graphs(
    config: Any, model: torch.nn.Module, kv_cache: torch.Tensor, max_model_len: int
) -> DecodeGraphRunner | None:
    """A draft model's full graphs over its own KV cache (``workers/spec/draft_model.py``): its
    proposal forwards (one token per request) replay decode graphs, its first forward of a
    step (the last token and the few positions it catches up, at most K + 1) a verification
    graph. None where the target gets no full graphs. Their memory is logged; the KV budget
    was sized before the draft existed and does not reserve it (docs/architecture.md)."""
    mode = config.graphs.cuda_graph_mode
    if not graphs_allowed(config, kv_cache.device) or not uses_full_decode(mode):
        return None
    backend = CudaGraphBackend(kv_cache.device)
    graphs = capture_step_graphs(
        config, model, kv_cache, max_model_len, backend, log=False, full_only=True
    )
    logger.info(
        "draft model: CUDA graphs for its proposal forwards, %.1f MiB in %.2f s (outside the "
        "KV budget)",
        graphs.num_bytes / 2**20,
        graphs.seconds,
    )
    return graphs.decode
