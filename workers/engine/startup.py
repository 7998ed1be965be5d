"""One engine's start-up, in the order the memory budget needs it:

    load_engine_model   weights (rank 0's share under TP, the ranks started),
                        dtype, end-of-sequence ids; a draft model's
                        (workers/spec/loading.py)
    size_kv_cache       context length; torch.compile of the forward
                        (workers/compile/) before the profile, so the profile
                        measures the forward the engine runs; one step's
                        activation and CUDA graph memory (workers/graphs/);
                        the KV blocks what is left holds (every TP rank
                        agreeing); the cache allocated (and a draft model's,
                        with as many blocks: a block costs both)
    scheduler_config    the scheduler's limits over that cache
    make_connector      the KV connector's scheduler and worker sides
    build_runner        CUDA graphs over the real cache, the model runner
                        (under TP: once every worker is ready)

Each returns what ``EngineCore`` keeps; none keeps state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.scheduler import SchedulerConfig
from tandem.workers.checkpoints.hf_config import config_namespace, end_token_ids
from tandem.workers.checkpoints.loader import load_model, resolve_model_path
from tandem.workers.compile.model import compile_before_sizing
from tandem.workers.config import EngineConfig
from tandem.workers.graphs.build import StepGraphs, build_draft_graphs, build_step_graphs
from tandem.workers.graphs.memory import StepMemory, profile_step_memory
from tandem.workers.runner.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for
from tandem.workers.runner.model_runner import DEFAULT_DENSE_DECODE_BYTES, ModelRunner
from tandem.workers.spec.loading import LoadedDraft, load_draft_model

MAX_DEFAULT_MODEL_LEN = 4096


@dataclass
class LoadedModel:
    model_path: str
    model: Any  # workers.models: a Llama/Qwen module (rank 0's shard under TP)
    hf_config: Any
    dtype: torch.dtype
    eos_token_id: int | None
    extra_eos_ids: list[int]  # further end ids: stop tokens of every request
    device: torch.device
    tp: Any = None  # workers.parallel.executor.TPExecutor with TP > 1
    draft: LoadedDraft | None = None  # speculative decoding with a draft model


@dataclass
class SizedKVCache:
    max_model_len: int
    num_blocks: int
    kv_cache: Any  # workers.runner.kv_cache.allocate_kv_cache's cache
    compile_report: Any  # workers.compile.model.compile_before_sizing's report
    step_memory: StepMemory
    draft_kv_cache: Any = None  # the draft model's: the same blocks, its own shape


def load_engine_model(config: EngineConfig, model_config: dict | None = None) -> LoadedModel:
    """This process's model. With ``tensor_parallel_size > 1`` this process
    is rank 0 (``workers/parallel/``): the executor starts the other ranks.
    ``model_config``: the model's config as ``hf_config.plain_config`` gives it (the gateway
    read it once); None reads it here."""
    if config.parallel.torch_threads > 0:
        torch.set_num_threads(config.parallel.torch_threads)
    device = torch.device(config.model.device)
    model_path = resolve_model_path(config.model.name)
    tp = None
    if config.parallel.tensor_parallel_size > 1:
        from tandem.workers.parallel.executor import TPExecutor

        tp = TPExecutor(config, model_path, model_config)
        model, hf_config = tp.model, tp.hf_config
    else:
        given = config_namespace(model_config) if model_config is not None else None
        model, hf_config = load_model(model_path, config.model.dtype, device, hf_config=given)
    eos_ids = end_token_ids(hf_config)
    dtype = next(model.parameters()).dtype
    draft = load_draft_model(config.speculative(), model_path, model, dtype, device)
    return LoadedModel(
        model_path=model_path,
        model=model,
        hf_config=hf_config,
        dtype=dtype,
        eos_token_id=eos_ids[0] if eos_ids else None,
        extra_eos_ids=eos_ids[1:],
        device=device,
        tp=tp,
        draft=draft,
    )


def size_kv_cache(config: EngineConfig, loaded: LoadedModel) -> SizedKVCache:
    """Measure what a step needs, then allocate the KV cache from the rest.
    ``max_model_len`` unset: the model's context, capped at
    ``MAX_DEFAULT_MODEL_LEN`` and at what the cache holds."""
    m = loaded.model
    max_len = config.model.max_model_len or min(m.max_context_len, MAX_DEFAULT_MODEL_LEN)
    if max_len > m.max_context_len:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's context length {m.max_context_len}"
        )
    if loaded.draft is not None and max_len > loaded.draft.max_context_len:
        raise ValueError(
            f"max_model_len {max_len} exceeds the draft model's context length "
            f"{loaded.draft.max_context_len} (speculative_config.model)"
        )
    block_bytes = bytes_per_block(
        m.num_layers, config.cache.block_size, m.num_kv_heads, m.head_dim, loaded.dtype
    )
    if loaded.draft is not None:  # a block of the draft's KV per block of the target's
        d = loaded.draft.model
        block_bytes += bytes_per_block(
            d.num_layers, config.cache.block_size, d.num_kv_heads, d.head_dim, loaded.dtype
        )
    # workers/compile/: torch.compile of the forward, first, so that the profile below
    # measures the forward the engine runs (the compiled graphs hold no cache)
    compile_report = compile_before_sizing(config, m)
    # activation peak and CUDA graphs, measured to come out of the KV budget (CUDA only)
    step_memory = profile_step_memory(config, m, max_len)
    num_blocks = num_blocks_for(
        block_bytes=block_bytes,
        num_kv_blocks=config.cache.num_kv_blocks,
        kv_cache_memory=config.cache.kv_cache_memory,
        gpu_memory_utilization=config.cache.gpu_memory_utilization,
        device=loaded.device,
        step_bytes=step_memory.num_bytes,
    )
    if loaded.tp is not None:
        num_blocks = loaded.tp.agree_num_blocks(num_blocks)
    if config.model.max_model_len is None:
        # Default: the model's length, but never more than the cache holds.
        max_len = min(max_len, num_blocks * config.cache.block_size)
    kv_cache = allocate_kv_cache(
        num_blocks,
        m.num_layers,
        config.cache.block_size,
        m.num_kv_heads,
        m.head_dim,
        loaded.dtype,
        loaded.device,
        layout=config.cache.kv_layout,
    )
    draft_kv_cache = None
    if loaded.draft is not None:
        d = loaded.draft.model
        draft_kv_cache = allocate_kv_cache(
            num_blocks,
            d.num_layers,
            config.cache.block_size,
            d.num_kv_heads,
            d.head_dim,
            loaded.dtype,
            loaded.device,
            layout=config.cache.kv_layout,
        )
    return SizedKVCache(max_len, num_blocks, kv_cache, compile_report, step_memory, draft_kv_cache)


def scheduler_config(config: EngineConfig, num_blocks: int, max_model_len: int) -> SchedulerConfig:
    """The scheduler's config: the scheduling section whole, the sizes start-up
    resolved, and the cache and KV-load settings the scheduler shares."""
    return SchedulerConfig.of(
        config.scheduler,
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
        block_size=config.cache.block_size,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        prefix_caching_hash_algo=config.cache.prefix_caching_hash_algo,
        load_failure_policy=config.kv_transfer.load_failure_policy,
        speculative=config.speculative(),
    )


def make_connector(config: EngineConfig, hf_config: Any) -> tuple[Any, Any]:
    """``(scheduler side, worker side)`` of the configured KV connector, or
    ``(None, None)`` without one."""
    tiers = None
    if config.offload.kv_offloading_size or config.offload.kv_offloading_disk_size:  # tiers
        from tandem.kvtransfer.tiers.config import tier_config
        from tandem.kvtransfer.tiers.connector import create_tier_connector

        tiers = create_tier_connector(tier_config(config))
    if not config.kv_transfer.connector:
        return tiers or (None, None)
    from tandem.kvtransfer.registry import create_connector
    from tandem.workers.parallel.connector_hook import kv_transfer_config

    peer = create_connector(kv_transfer_config(config, hf_config))
    if tiers is None:
        return peer
    from tandem.kvtransfer.tiers.chain import ChainedSchedulerSide, ChainedWorkerSide

    return ChainedSchedulerSide(peer[0], tiers[0]), ChainedWorkerSide(peer[1], tiers[1])


def build_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    cache: SizedKVCache,
    connector_worker: Any,
    overlap: bool,
) -> tuple[StepGraphs, Any]:
    """The step graphs over the real cache and the runner that uses them.
    Under TP the runner is rank 0's front (``TPRunner``), returned once every
    worker is ready."""
    graphs = build_step_graphs(
        config, loaded.model, cache.kv_cache, cache.max_model_len, cache.step_memory.graph_bytes
    )
    drafter = None
    if loaded.draft is not None:
        from tandem.workers.spec.draft_model import DraftModel

        dense_bytes = config.cache.dense_decode_bytes
        if dense_bytes is None:  # the runner's rule: CPU fp32 only
            on_cpu_fp32 = loaded.device.type == "cpu" and loaded.dtype == torch.float32
            dense_bytes = DEFAULT_DENSE_DECODE_BYTES if on_cpu_fp32 else 0
        drafter = DraftModel(
            loaded.draft.model,
            cache.draft_kv_cache,
            config.cache.block_size,
            config.graphs.prefill_attention,
            dense_bytes,
        )
        drafter.graphs = build_draft_graphs(
            config, loaded.draft.model, cache.draft_kv_cache, cache.max_model_len
        )
    runner: Any = ModelRunner(
        loaded.model,
        cache.kv_cache,
        config.cache.block_size,
        loaded.eos_token_id,
        connector=connector_worker,
        seed=config.model.seed,
        dense_decode_bytes=config.cache.dense_decode_bytes,
        decode_graphs=graphs.decode,
        piecewise_graphs=graphs.piecewise,
        prefill_attention=config.graphs.prefill_attention,
        overlap=overlap,
        drafter=drafter,
    )
    if loaded.tp is not None:
        runner = loaded.tp.start(runner)
    return graphs, runner
