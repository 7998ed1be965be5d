"""What a step and the CUDA graphs need on the device, measured before the KV cache is sized.

``gpu_memory_utilization`` (a pool's share on a shared GPU) bounds all the engine holds::

    |<---------------------- total x gpu_memory_utilization ---------------------->|
    | weights | activation peak | graphs: pool + exec + static buffers | KV cache      |
      loaded    profiling step    profiling capture                     what is left

The KV cache gets what is left, so the middle two must be known before it is allocated; but
a captured graph bakes in the KV cache's address, so the real graphs can only be captured
after it. Hence, at start-up (CUDA, cache sized from the utilization, one GPU):

1. a profiling step of the forward the engine will run (with ``--compile-model on`` the
   compiled one: ``workers.compile.model.compile_before_sizing`` ran first), over a one-block
   dummy cache (every slot -1: nothing is written): ``max_num_batched_tokens`` tokens
   through the model, then logits and a top-p / top-k / logprobs sampling of
   ``min(max_num_seqs, tokens)`` rows. Its activation peak is torch's peak reserved bytes
   above what was reserved before.
2. a profiling capture: the same graphs (modes, sizes, static buffers) over the dummy cache,
   measured as device free memory before minus after (graph pools and the driver's graph
   objects both count; capped for a shared GPU, see ``runner.timed_capture``), then
   destroyed and returned to the device.
3. the KV budget takes both out (``workers.runner.kv_cache.gpu_kv_budget_bytes``); the real capture
   runs after the cache is allocated and its log line sets its memory beside the profiled.

Why capture everything twice rather than estimate from a few graphs (as vLLM does): all
graphs share one pool, which reuses what earlier captures freed, so the memory of N graphs is
far below N times one graph's; extrapolating overshoots and starves the KV cache. Measuring the
same captures the engine will make costs their capture time again at start-up (logged) and
gives the number itself. Capture-first-then-size would need the graphs re-pointed at the real
cache, which a CUDA graph cannot be.

Skipped (nothing reserved) on CPU, with an explicit ``num_kv_blocks`` or ``kv_cache_memory``
(the user sized the cache), and with tensor parallelism (a rank-0 forward would wait in
collectives the other ranks never join).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kernels import AttentionMetadata
from tandem.kernels.prefill_attention import use_sdpa_prefills
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.graphs.build import GRAPH_BYTES_SLACK, capture_step_graphs
from tandem.workers.graphs.runner import CudaGraphBackend, graphs_allowed
from tandem.workers.runner.kv_cache import allocate_model_kv_cache
from tandem.workers.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

# The profiling step samples as the costliest request would: sorted top-p/top-k and logprobs.
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5, seed=0)


@dataclass
class StepMemory:
    """Device bytes the KV budget must leave for activations and graphs."""

    activation_bytes: int = 0
    graph_bytes: int = 0
    seconds: float = 0.0  # the profiling step and capture together

    @property
    def num_bytes(self) -> int:
        return self.activation_bytes + self.graph_bytes


def profile_forward(
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    block_size: int,
    num_tokens: int,
    max_model_len: int,
    num_sampled: int,
    sdpa_prefills: bool = False,
) -> None:
    """One eager step of ``num_tokens`` prompt tokens (sequences of at most ``max_model_len``)
    over ``kv_cache``, whose block 0 every table points at (any cache of >= 1 block; every slot
    is -1, so nothing is written), then logits and sampling of ``num_sampled`` rows.
    ``sdpa_prefills``: attend as the engine's prompts will (``--prefill-attention``)."""
    lengths = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lengths.append(num_tokens % max_model_len)
    tables = [[0] * math.ceil(n / block_size) for n in lengths]
    dev = kv_cache.device
    # inputs made in inference mode, as the runner's step makes them: a compiled forward
    # (--compile-model) guards on it, and must run its warm graphs here, not compile anew
    with torch.inference_mode():
        meta = AttentionMetadata.build(tables, lengths, lengths, block_size, dev)
        meta.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.long, device=dev)
        meta.sdpa_prefills = sdpa_prefills
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        hidden = model(ids, positions, kv_cache, meta)
        rows = min(num_sampled, num_tokens)
        logits = model.compute_logits(hidden[:rows])
        Sampler(0).sample(logits, [_PROFILE_PARAMS] * rows, [0] * rows, [0] * rows, [None] * rows)


def profile_step_memory(config: Any, model: torch.nn.Module, max_model_len: int) -> StepMemory:
    """Measure (CUDA) the activation peak of the largest step and the memory of the graphs
    ``config`` asks for; zeros where nothing is reserved (module docstring)."""
    device = torch.device(config.model.device)
    if device.type != "cuda" or config.cache.num_kv_blocks is not None:
        return StepMemory()
    if config.cache.kv_cache_memory is not None or config.parallel.tensor_parallel_size > 1:
        return StepMemory()
    start = time.perf_counter()
    dtype = next(model.parameters()).dtype
    dummy = allocate_model_kv_cache(config, model, 1, device)
    _release(device)
    torch.cuda.reset_peak_memory_stats(device)
    reserved_before = torch.cuda.memory_reserved(device)
    profile_forward(
        model,
        dummy,
        config.cache.block_size,
        config.scheduler.max_num_batched_tokens,
        max_model_len,
        config.scheduler.max_num_seqs,
        use_sdpa_prefills(config.graphs.prefill_attention, device, dtype),
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    _release(device)
    # What stays reserved (e.g. cuBLAS's workspace) is the engine's own at sizing time and
    # counted there; the activations are the peak above it.
    activation_bytes = max(0, peak - max(reserved_before, torch.cuda.memory_reserved(device)))
    graph_bytes = 0
    if graphs_allowed(config, device):
        graph_bytes = _profile_capture(config, model, dummy, max_model_len)
    del dummy
    _release(device)
    memory = StepMemory(activation_bytes, graph_bytes, time.perf_counter() - start)
    logger.info(
        "profiled step memory in %.2f s: activations %.1f MiB (a %d-token step), "
        "CUDA graphs %.1f MiB; both come out of the KV-cache budget",
        memory.seconds,
        activation_bytes / 2**20,
        config.scheduler.max_num_batched_tokens,
        graph_bytes / 2**20,
    )
    return memory


def _profile_capture(
    config: Any, model: torch.nn.Module, kv_cache: torch.Tensor, max_model_len: int
) -> int:
    """Device bytes of the graphs ``config`` asks for, captured over ``kv_cache`` and then
    destroyed (their static buffers count: they live until the measurement). What torch
    still holds after they are destroyed (the capture stream's cuBLAS workspace, which the
    real capture reuses: ``runner.capture_stream``) is left out: the budget counts it as the
    engine's own."""
    device = kv_cache.device
    backend = CudaGraphBackend(device)
    reserved_before = torch.cuda.memory_reserved(device)
    graphs = capture_step_graphs(config, model, kv_cache, max_model_len, backend, log=False)
    num_bytes = graphs.num_bytes
    backend.release()
    del graphs
    _release(device)
    kept = max(0, torch.cuda.memory_reserved(device) - reserved_before)
    logger.info(
        "profiling capture took %.1f MiB; %.1f MiB stayed reserved after its graphs were "
        "destroyed (left out)",
        num_bytes / 2**20,
        kept / 2**20,
    )
    if kept > GRAPH_BYTES_SLACK * 16:
        logger.warning("destroying the profiling graphs left %.1f MiB reserved", kept / 2**20)
    return max(0, num_bytes - kept)


def _release(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
