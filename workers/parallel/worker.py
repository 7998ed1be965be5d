"""A tensor-parallel worker process (or Ray actor): ranks 1..N-1 of an engine.

    hello -> join the process group -> load this rank's weight slices
          -> agree on the KV block count (min over ranks) -> allocate the KV shard
          -> ready -> loop: command -> ModelRunner.execute -> reply

The worker runs the same ``ModelRunner`` as rank 0 on the same
``SchedulerOutput``: same inputs, same collectives (the sharded layers
all-reduce; logits are all-gathered), same sampling (same seed, same calls),
so it keeps the same token history without being told; only rank 0's
sampled tokens leave the engine. A reply per step carries this rank's KV
connector output (merged on rank 0 by ``kvtransfer/tp_outputs.py``).

Any exception: an error reply, then exit(1). A worker whose engine core is
gone (parent dead) exits on its next idle poll. From its hello on, a thread
sends heartbeats (``workers/parallel/heartbeat.py``) so rank 0 can tell a
stopped rank from a slow one.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import traceback
from typing import Any

import msgspec
import torch

from tandem.workers.parallel.heartbeat import HeartbeatSender, heartbeat_interval_s
from tandem.workers.parallel.messages import (
    CMD_CHECK,
    CMD_KV_STATS,
    CMD_RELEASE_IDLE,
    CMD_STOP,
    REPLY_CHECK,
    REPLY_ERROR,
    REPLY_HELLO,
    REPLY_KV_STATS,
    REPLY_READY,
    REPLY_STEP,
    WorkerCommand,
    WorkerReply,
    WorkerSpec,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100
# test hooks (EngineConfig.runtime.extra): when this step's command arrives, exit
# without a word, or raise (an error reply, then exit)
FAULT_EXIT_AT_STEP = "tp_fault_exit_at_step"
FAULT_RAISE_AT_STEP = "tp_fault_raise_at_step"


def rank_device(device: str, rank: int) -> torch.device:
    """CUDA: rank ``r`` uses the ``r``-th visible GPU; CPU: the CPU."""
    dev = torch.device(device)
    return torch.device("cuda", rank) if dev.type == "cuda" else dev


def kv_blocks_for_model(config: Any, model: Any, device: torch.device) -> int:
    """KV blocks this rank's budget holds for its model shard (``num_blocks_for``)."""
    from tandem.workers.runner.kv_cache import bytes_per_block, num_blocks_for

    dtype = next(model.parameters()).dtype
    block_bytes = bytes_per_block(
        model.num_layers, config.cache.block_size, model.num_kv_heads, model.head_dim, dtype
    )
    return num_blocks_for(
        block_bytes=block_bytes,
        num_kv_blocks=config.cache.num_kv_blocks,
        kv_cache_memory=config.cache.kv_cache_memory,
        gpu_memory_utilization=config.cache.gpu_memory_utilization,
        device=device,
    )


def run_worker(spec: WorkerSpec) -> None:
    """Process entry point (``torch.multiprocessing`` spawn target)."""
    import zmq

    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.setsockopt(zmq.LINGER, 0)
    commands.connect(spec.command_addr)
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 2000)
    replies.connect(spec.reply_addr)
    enc = msgspec.msgpack.Encoder()

    def reply(kind: int, **fields: Any) -> None:
        replies.send(enc.encode(WorkerReply(kind, spec.rank, **fields)))

    connector = None
    code = 0
    step_timeout_s = spec.config.parallel.tp_step_timeout_s
    heartbeat = HeartbeatSender(
        ctx, spec.heartbeat_addr, spec.rank, heartbeat_interval_s(step_timeout_s)
    )
    try:
        reply(REPLY_HELLO)
        heartbeat.start()
        runner, connector = _build_rank(spec)
        port = getattr(connector, "side_channel_port", None) or 0
        reply(REPLY_READY, side_channel_port=port)
        _serve(spec, commands, runner, reply)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then exit
        code = 1
        logger.error("TP worker rank %d failed:\n%s", spec.rank, traceback.format_exc())
        reply(REPLY_ERROR, error=f"rank {spec.rank}: {type(exc).__name__}: {exc}")
    finally:
        heartbeat.stop()
        if connector is not None:
            connector.shutdown()
        commands.close()
        replies.close()
        ctx.term()
    os._exit(code)  # no atexit: the process group's sockets die with the process


def _build_rank(spec: WorkerSpec) -> tuple[Any, Any]:
    from tandem.workers.checkpoints.hf_config import end_token_ids
    from tandem.workers.parallel.connector_hook import make_rank_connector
    from tandem.workers.parallel.group import TPGroup, make_store
    from tandem.workers.parallel.loading import load_rank_model
    from tandem.workers.parallel.plan import make_plan
    from tandem.workers.runner.kv_cache import allocate_model_kv_cache
    from tandem.workers.runner.model_runner import ModelRunner

    config = spec.config
    if config.parallel.torch_threads > 0:
        torch.set_num_threads(config.parallel.torch_threads)
    device = rank_device(
        config.model.device, spec.rank if spec.device_index < 0 else spec.device_index
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = make_store(spec.rank, spec.tp_size, spec.store_host, spec.store_port, spec.timeout_s)
    group = TPGroup.connect(
        store, spec.rank, spec.tp_size, device, spec.timeout_s, config.parallel.tp_step_timeout_s
    )
    plan = make_plan(spec.hf_config, spec.tp_size, spec.rank)
    model = load_rank_model(
        spec.model_path, spec.hf_config, config.model.dtype, device, plan, group
    )
    num_blocks = group.min_int(kv_blocks_for_model(config, model, device))
    kv_cache = allocate_model_kv_cache(config, model, num_blocks, device)
    connector = make_rank_connector(config, spec.hf_config, spec.rank)
    end_ids = end_token_ids(spec.hf_config)
    runner = ModelRunner(
        model,
        kv_cache,
        config.cache.block_size,
        end_ids[0] if end_ids else None,
        connector=connector,
        seed=config.model.seed,
        dense_decode_bytes=config.cache.dense_decode_bytes,
        prefill_attention=config.graphs.prefill_attention,
    )
    return runner, connector


def _serve(spec: WorkerSpec, commands: Any, runner: Any, reply: Any) -> None:
    import zmq

    dec = msgspec.msgpack.Decoder(WorkerCommand)
    meta_type = getattr(runner.connector, "metadata_type", None)
    exit_step = spec.config.runtime.extra.get(FAULT_EXIT_AT_STEP)
    raise_step = spec.config.runtime.extra.get(FAULT_RAISE_AT_STEP)
    parent = multiprocessing.parent_process()
    while True:
        if not commands.poll(IDLE_POLL_MS, zmq.POLLIN):
            if parent is not None and not parent.is_alive():
                logger.info("TP worker rank %d: the engine core is gone; exiting", spec.rank)
                return
            continue
        cmd = dec.decode(commands.recv())
        if cmd.kind == CMD_STOP:
            return
        if cmd.kind == CMD_KV_STATS:
            stats = runner.connector.stats() if runner.connector is not None else {}
            reply(REPLY_KV_STATS, step=cmd.step, kv_stats=stats)
            continue
        if cmd.kind == CMD_CHECK:
            reply(REPLY_CHECK, step=cmd.step, error=_check(spec.rank, runner.connector, cmd.idle))
            continue
        if cmd.kind == CMD_RELEASE_IDLE:
            # never on this process's own clock: the dense rows decide the token
            # order of a step, which must be the same on every rank
            if runner.dense is not None:
                runner.dense.release_if_idle(float("inf"))
            continue
        if cmd.step == exit_step:
            os._exit(17)
        if cmd.step == raise_step:
            raise RuntimeError(f"injected fault at step {cmd.step}")
        so = cmd.scheduler_output
        if meta_type is not None and so.kv_connector_metadata is not None:
            so.kv_connector_metadata = msgspec.convert(so.kv_connector_metadata, meta_type)
        out = runner.execute(so)
        reply(REPLY_STEP, step=cmd.step, kv_connector_output=out.kv_connector_output)


def _check(rank: int, connector: Any, idle: bool) -> str | None:
    """The connector's ``check_integrity(idle)`` failure, as rank 0 will raise it."""
    check = getattr(connector, "check_integrity", None)
    if check is None:
        return None
    try:
        check(idle)
    except AssertionError as exc:
        return f"rank {rank}: {exc}"
    return None
