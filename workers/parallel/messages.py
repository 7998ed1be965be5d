"""What the engine core and its tensor-parallel workers say to each other.

    engine core (rank 0) --PUSH--> worker r:  WorkerCommand   (one per step, or stop)
    engine core (rank 0) <--PULL-- worker r:  WorkerReply     (hello, ready, one per step)

``WorkerSpec`` is not on the wire: it is the worker process's start argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from tandem.scheduler.messages import KVConnectorOutput, SchedulerOutput
from tandem.workers.config import EngineConfig

CMD_STEP = 0
CMD_STOP = 1
CMD_RELEASE_IDLE = 2  # rank 0 freed its idle dense-decode copy: free yours (same state)
CMD_KV_STATS = 3  # reply with your KV connector's stats()
CMD_CHECK = 4  # run your KV connector's check_integrity(idle): REPLY_CHECK, error if it fails

REPLY_HELLO = 0  # process up, about to join the process group
REPLY_READY = 1  # weights loaded, KV cache allocated, runner built
REPLY_STEP = 2  # a step done
REPLY_ERROR = 3  # the worker failed (it exits right after sending this)
REPLY_KV_STATS = 4
REPLY_HEARTBEAT = 5  # from the worker's heartbeat thread (workers/parallel/heartbeat.py)
REPLY_CHECK = 6  # CMD_CHECK done; ``error``: the failed check (the worker goes on)


class WorkerFailed(RuntimeError):
    """A tensor-parallel engine lost a worker (or a worker raised): the whole
    engine is failed; the message names the rank and the cause."""


class WorkerCommand(msgspec.Struct, array_like=True, omit_defaults=True):
    kind: int
    step: int = 0
    # kv_connector_metadata travels as plain data; the rank's connector
    # declares its type (``metadata_type``) and the worker converts it back
    scheduler_output: SchedulerOutput | None = None
    idle: bool = False  # CMD_CHECK: the engine holds no request


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True):
    kind: int
    rank: int
    step: int = 0
    kv_connector_output: KVConnectorOutput | None = None
    error: str | None = None
    side_channel_port: int = 0  # REPLY_READY: the rank's KV side channel (0: none)
    kv_stats: dict[str, float] = {}  # REPLY_KV_STATS: the rank's connector stats()
    sent_s: float = 0.0  # REPLY_HEARTBEAT: the worker's time.monotonic() when sent


@dataclass
class WorkerSpec:
    """Everything a worker process needs to start (pickled by spawn)."""

    config: EngineConfig
    model_path: str  # resolved HF directory (GGUF already converted)
    # its load_config() read once by rank 0, as plain attributes: unpickling a
    # transformers config class would import transformers (seconds per worker)
    hf_config: Any
    rank: int
    tp_size: int
    store_host: str
    store_port: int
    command_addr: str  # the worker connects its PULL here
    reply_addr: str  # and its PUSH here
    heartbeat_addr: str  # its heartbeat thread's PUSH (workers/parallel/heartbeat.py)
    timeout_s: float  # rendezvous and start-up collectives timeout
    # the CUDA device index this rank uses; -1: its rank (local processes see
    # every GPU of the engine, a Ray worker actor only its own: 0)
    device_index: int = -1
