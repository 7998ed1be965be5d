"""``--compile-model``: ``torch.compile`` the model's forward, warmed up at engine start-up.

What is traced and what is not::

    model(input_ids, positions, kv_cache, meta)          # the runner's and graph runner's call
      -> step_context(kv_cache, meta)                    # attention_op.py reads them there
      -> compiled(input_ids, positions)          # one graph: embed, norms, matmuls, rope, MLP
           per layer: torch.ops.tandem.attention(...)   # opaque: KV write + attention

* Shapes: the token dimension is marked dynamic, so a forward of 1 token (a decode of one
  request; torch specialises sizes 0 and 1) and one of 2+ tokens are the only two graphs
  (per id dtype: int64 from eager steps, and on CUDA int32 from the decode graphs' static
  buffers), all compiled by the start-up warm-up (dummy steps whose slots are -1: nothing is
  written to the cache). The warm-up's seconds are the compile time, logged and returned.
* Inside the graph ``kernels.dispatch`` takes the torch references, so the compiler fuses the
  norms and SiLU itself (on CUDA it emits its own Triton kernels for them); inside the op the
  usual kernels run (Triton KV write and paged attention, or the SDPA prefill split, on CUDA).
* CUDA graphs: decode graphs capture the compiled forward like the eager one (the warm-up has
  already compiled both graphs, so a capture only records kernels).
* Start-up order (``compile_before_sizing``): the engine compiles before it sizes the KV cache,
  warming up over a one-block dummy cache. The compiled graphs hold no cache (the op reads the
  step's from ``step_context``), so they serve the real cache unchanged, and the profiling step
  and capture (``workers/graphs/memory.py``) measure the compiled forward: inductor's buffers
  and the graphs captured over them come out of the KV budget like the eager ones.
* Not with tensor parallelism (the sharded layers' collectives are not traced).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kernels import AttentionMetadata
from tandem.workers.compile.attention_op import COMPILED_STEP, step_context
from tandem.workers.config.checks import COMPILE_MODEL_MODES
from tandem.workers.runner.kv_cache import allocate_model_kv_cache

logger = logging.getLogger(__name__)


def use_compile(mode: str, device: torch.device | str, tensor_parallel_size: int = 1) -> bool:
    """Whether ``EngineConfig.graphs.compile_model`` compiles on this engine.

    ``auto`` runs eager (README, "torch.compile"): on CPU the compiled SmolLM2 decode step was
    7-8% faster on the quietest run (more under load) and prefill even, while every engine
    start pays the compile (seconds with inductor's disk cache, minutes without); on CUDA until
    ``benchmarks/gpu_engine.py --compile-rows`` has measured it. Never with tensor parallelism.
    """
    if mode not in COMPILE_MODEL_MODES:
        raise ValueError(
            f"compile_model must be one of {', '.join(COMPILE_MODEL_MODES)}, got {mode!r}"
        )
    if tensor_parallel_size > 1:
        if mode == "on":
            raise ValueError("compile_model 'on' needs tensor_parallel_size 1")
        return False
    return mode == "on"


@dataclass
class CompileReport:
    seconds: float  # warm-up wall time: tracing + compiling both graphs + two dummy steps
    num_graphs: int


def compile_model(
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    block_size: int,
    backend: str | Callable[..., Any] = "inductor",
) -> CompileReport:
    """Replace ``model.forward`` by the compiled forward (same signature and results) and
    compile it now. ``kv_cache``/``block_size``: the engine's, used by the warm-up steps.
    ``backend``: torch.compile's (tests use ``aot_eager``: the same tracing, no codegen)."""
    eager_forward = model.forward

    def traced(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # the cache and the metadata come from the step context (attention_op.py)
        return eager_forward(input_ids, positions, None, COMPILED_STEP)

    compiled = torch.compile(traced, fullgraph=True, backend=backend)

    def forward(
        input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta
    ) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        with step_context(kv_cache, meta):
            return compiled(input_ids, positions)

    model.forward = forward
    # eager steps send int64 ids/positions; CUDA decode graphs read them from int32 buffers
    id_dtypes = (torch.long, torch.int32) if kv_cache.is_cuda else (torch.long,)
    start = time.perf_counter()
    with torch.inference_mode():
        for dtype in id_dtypes:
            for num_tokens in (1, 2):  # the one-token graph, then the dynamic one
                _dummy_step(model, kv_cache, block_size, num_tokens, dtype)
    if kv_cache.is_cuda:
        torch.cuda.synchronize(kv_cache.device)
    report = CompileReport(time.perf_counter() - start, 2 * len(id_dtypes))
    logger.info(
        "compiled the model's forward (torch.compile, %d graphs: 1 token and 2+ tokens, "
        "ids %s) in %.1f s",
        report.num_graphs,
        "/".join(str(d).removeprefix("torch.") for d in id_dtypes),
        report.seconds,
    )
    return report


def compile_before_sizing(
    config: Any, model: torch.nn.Module, backend: str | Callable[..., Any] = "inductor"
) -> CompileReport | None:
    """Compile ``model``'s forward when ``config.graphs.compile_model`` asks for it on this engine
    (``use_compile``), before the KV cache exists: the warm-up runs over a one-block dummy cache
    of ``config``'s block size and layout, freed on return. None when the engine runs eager.
    Call it before ``profile_step_memory`` so the profile measures the compiled forward."""
    device = torch.device(config.model.device)
    if not use_compile(config.graphs.compile_model, device, config.parallel.tensor_parallel_size):
        return None
    dummy = allocate_model_kv_cache(config, model, 1, device)
    return compile_model(model, dummy, config.cache.block_size, backend)


def _dummy_step(
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    block_size: int,
    num_tokens: int,
    id_dtype: torch.dtype,
) -> None:
    """One prompt of ``num_tokens`` in block 0 whose slots are all -1: attention reads block 0,
    nothing is written."""
    device = kv_cache.device
    table = [0] * -(-num_tokens // block_size)  # block 0 again and again: nothing is written
    meta = AttentionMetadata.build([table], [num_tokens], [num_tokens], block_size, device)
    meta.slot_mapping = torch.full_like(meta.slot_mapping, -1)
    # compiled graphs guard on inference mode: eager steps make their int64 inputs in it
    # (the runner's step), the decode graphs read views of int32 buffers made outside it
    with torch.inference_mode(id_dtype != torch.int32):
        ids = torch.zeros(num_tokens, dtype=id_dtype, device=device)
        positions = torch.arange(num_tokens, dtype=id_dtype, device=device)
    model(ids, positions, kv_cache, meta)
