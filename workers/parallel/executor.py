"""Rank 0 of a tensor-parallel engine: starts the workers, drives every step.

Rank 0 lives in the engine core process (the scheduler runs once, there)::

    EngineCore.step
      so = scheduler.schedule()
      TPRunner.execute(so):  encode so once --PUSH--> rank 1..N-1   (ZMQ, msgpack)
                             rank 0's ModelRunner.execute(so)       (collectives join
                                                                     all ranks' forwards)
                             <--PULL-- one reply per worker          (KV connector output)
      scheduler.update_from_output(so, rank 0's output)

Workers are local processes (``torch.multiprocessing`` forkserver) for
``tandem generate``; when the engine core is a Ray actor they are Ray actors
in the bundles of its placement group (``workers/parallel/ray_workers.py``).
Either way ``pick_launcher`` (``workers/parallel/launch.py``) hands back a
``start(spec)`` whose handles answer ``pid``, ``exitcode``, ``join``,
``terminate`` and ``kill``.

Failure makes the engine fail as one unit, never hang: a worker that exits
or raises makes the step (or the start) raise ``WorkerFailed`` naming the
rank and its exit code or error (gloo collectives raise when a peer's
connection closes; replies are awaited by polling the worker's liveness);
the remaining workers are stopped and every later step raises the same.
A worker that is alive but silent (SIGSTOP, a frozen host) is bounded by
``tp_step_timeout_s`` (T): every step collective and every step reply waits
at most T, and a rank whose heartbeat is older than T/2 is named as
unresponsive (``workers/parallel/heartbeat.py``), in a step or while idle::

    rank r stopped while idle         -> failed when its heartbeat is T/2 old
    rank r stopped before/in a step   -> the collective raises after T; the
                                         rank whose heartbeat went stale is named
                                         (at most T/2 more), then killed
The engine core's caller decides what the requests see (``LLM``: an error
finish; the Ray actor: the process exits, Ray restarts it with a new epoch).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Any

import msgspec
import torch

from tandem.kvtransfer.tp_outputs import ConnectorOutputMerger
from tandem.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from tandem.workers.config import EngineConfig
from tandem.workers.parallel.group import TPGroup, make_store
from tandem.workers.parallel.heartbeat import HeartbeatBook
from tandem.workers.parallel.launch import first_exit, kill_all, pick_launcher, stop_workers
from tandem.workers.parallel.messages import (
    CMD_CHECK,
    CMD_KV_STATS,
    CMD_RELEASE_IDLE,
    CMD_STEP,
    REPLY_CHECK,
    REPLY_ERROR,
    REPLY_HELLO,
    REPLY_KV_STATS,
    REPLY_READY,
    REPLY_STEP,
    WorkerCommand,
    WorkerFailed,
    WorkerReply,
    WorkerSpec,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # spawn + import + load of every worker
STARTUP_COLLECTIVE_TIMEOUT_S = 600.0  # joining the group, agreeing on the KV size
STATS_TIMEOUT_S = 30.0
# steps wait EngineConfig.parallel.tp_step_timeout_s
# connector stats() keys that add up over ranks (each rank reads its own heads)
SUMMED_KV_STATS = ("kv_transfer_bytes_total", "num_descriptors")
_POLL_MS = 20
HOST = "127.0.0.1"


class TPExecutor:
    """Start ``config.parallel.tensor_parallel_size - 1`` workers and load rank 0's shard.

    Then the engine core calls ``agree_num_blocks`` (a collective every rank
    makes) and ``start(runner)`` (waits until every worker is ready) and steps
    through the returned ``TPRunner``. ``ValueError`` before anything starts
    when the model cannot be split ``tensor_parallel_size`` ways.
    """

    def __init__(
        self, config: EngineConfig, model_path: str, model_config: dict | None = None
    ) -> None:
        import zmq

        from tandem.workers.checkpoints.hf_config import config_namespace, plain_config
        from tandem.workers.parallel.loading import load_rank_model
        from tandem.workers.parallel.plan import make_plan

        self.size = config.parallel.tensor_parallel_size
        self.step_timeout_s = config.parallel.tp_step_timeout_s
        self._started = False  # heartbeats count from start() on
        self._unresponsive: list[int] = []  # ranks to kill without asking first
        # plain attributes (the gateway's when it sent them): what every rank builds from
        self.hf_config = config_namespace(model_config or plain_config(model_path))
        self.plan = make_plan(self.hf_config, self.size, 0)  # ValueError: nothing started yet
        self.failed: str | None = None
        self.procs: list[Any] = []
        self._shutdown_lock = threading.Lock()
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        # replies read while looking for a worker's error, kept for ``_await``
        self._unread: collections.deque[WorkerReply] = collections.deque()
        reply_port = self._replies.bind_to_random_port(f"tcp://{HOST}")
        ranks = list(range(1, self.size))
        self.heartbeats = HeartbeatBook(self._ctx, HOST, ranks, self.step_timeout_s / 2)
        self._commands = []
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(WorkerReply)
        self._kv = ConnectorOutputMerger(self.size)
        self.num_steps = 0
        self._num_stats = 0
        # workers keep state of their own to check (KV tiers: kvtransfer/tiers/ranks.py)
        self.check_ranks = False
        self.worker_kv_ports: list[int] = []  # ranks 1.. side channels (prefill engines)
        # seconds rank 0 spent encoding + sending steps, and waiting for the
        # workers' replies after its own forward (benchmarks/tensor_parallel.py)
        self.broadcast_s = 0.0
        self.reply_wait_s = 0.0
        self.broadcast_bytes = 0
        try:
            store = make_store(0, self.size, HOST, 0, STARTUP_TIMEOUT_S)
            launcher = pick_launcher(config, self.size)
            for rank in range(1, self.size):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                port = sock.bind_to_random_port(f"tcp://{HOST}")
                self._commands.append(sock)
                spec = WorkerSpec(
                    config=config,
                    model_path=model_path,
                    hf_config=self.hf_config,
                    rank=rank,
                    tp_size=self.size,
                    store_host=HOST,
                    store_port=store.port,
                    command_addr=f"tcp://{HOST}:{port}",
                    reply_addr=f"tcp://{HOST}:{reply_port}",
                    heartbeat_addr=self.heartbeats.addrs[rank],
                    timeout_s=STARTUP_COLLECTIVE_TIMEOUT_S,
                )
                self.procs.append(launcher.start(spec))
            weakref.finalize(self, kill_all, self.procs)  # an engine dropped without shutdown()
            self._await(REPLY_HELLO, STARTUP_TIMEOUT_S)
            device = torch.device(config.model.device)
            self.group = TPGroup.connect(
                store, 0, self.size, device, STARTUP_COLLECTIVE_TIMEOUT_S, self.step_timeout_s
            )
            self.model = self._guard(
                load_rank_model,
                model_path,
                self.hf_config,
                config.model.dtype,
                device,
                self.plan,
                self.group,
            )
        except BaseException:
            self.shutdown()
            raise
        self._store = store  # rank 0 serves the rendezvous for the group's life

    # ---- start -------------------------------------------------------------

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest KV block count any rank's budget holds (all ranks call it)."""
        return self._guard(self.group.min_int, num_blocks)

    def start(self, runner: Any) -> TPRunner:
        """Wait until every worker is ready; steps go through the returned runner."""
        try:
            ready = self._await(REPLY_READY, STARTUP_TIMEOUT_S)
            self.worker_kv_ports = [r.side_channel_port for r in ready if r.side_channel_port]
        except BaseException:
            self.shutdown()
            raise
        self.heartbeats.restart_clock()
        self._started = True
        self.check_ranks = getattr(runner.connector, "store", None) is not None  # KV tiers
        return TPRunner(self, runner)

    # ---- steps -------------------------------------------------------------

    def execute(self, runner: Any, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; rank 0's output with every rank's KV output."""
        if self.failed is not None:
            raise WorkerFailed(self.failed)
        self._check_alive()
        self.num_steps += 1
        start_s = time.perf_counter()
        frame = self._enc.encode(WorkerCommand(CMD_STEP, self.num_steps, so))
        self._send(frame)
        self.broadcast_s += time.perf_counter() - start_s
        self.broadcast_bytes += len(frame)
        out = self._guard(runner.execute, so)
        start_s = time.perf_counter()
        replies = self._await(REPLY_STEP, self.step_timeout_s, step=self.num_steps)
        self.reply_wait_s += time.perf_counter() - start_s
        if runner.connector is not None:
            outputs = [out.kv_connector_output, *(r.kv_connector_output for r in replies)]
            out.kv_connector_output = self._kv.merge(outputs)
        return out

    def broadcast(self, kind: int, seq: int = 0, idle: bool = False) -> None:
        """A command without a scheduler output (``CMD_RELEASE_IDLE``,
        ``CMD_KV_STATS``, ``CMD_CHECK``) to every worker; ``seq`` matches its replies."""
        frame = self._enc.encode(WorkerCommand(kind, seq, idle=idle))
        self._send(frame)

    def _send(self, frame: bytes) -> None:
        """``frame`` to every worker, never blocking on a gone one: the PUSH
        socket of a worker whose process died (its kernel closed the
        connection) has no peer, and a blocking send would wait forever,
        before Ray (or waitpid) reports the exit. Waits for a peer at most
        ``step_timeout_s``, polling the workers' liveness meanwhile."""
        import zmq

        for rank, sock in enumerate(self._commands, start=1):
            deadline = time.monotonic() + self.step_timeout_s
            while True:
                try:
                    sock.send(frame, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    self._check_alive()
                    if time.monotonic() > deadline:
                        raise self._fail(
                            f"rank {rank} took no command within {self.step_timeout_s:g} s"
                        ) from None
                    time.sleep(_POLL_MS / 1000)

    def sum_kv_stats(self, rank0: dict[str, float]) -> dict[str, float]:
        """Rank 0's connector ``stats()`` with the bytes and descriptors of every
        worker's reads added (the other fields count requests, which every
        rank sees: rank 0's stand). Engine loop thread, between steps."""
        if self.failed is not None:
            return rank0
        replies = self.ask_workers(CMD_KV_STATS, REPLY_KV_STATS)
        out = dict(rank0)
        for key in SUMMED_KV_STATS:
            out[key] = rank0.get(key, 0.0) + sum(r.kv_stats.get(key, 0.0) for r in replies)
        return out

    def ask_workers(self, kind: int, reply: int, idle: bool = False) -> list[WorkerReply]:
        """Every worker's answer to ``kind`` (``CMD_KV_STATS``, ``CMD_CHECK``), rank order."""
        self._check_alive()
        self._num_stats += 1
        self.broadcast(kind, self._num_stats, idle=idle)
        return self._await(reply, STATS_TIMEOUT_S, step=self._num_stats)

    def check_integrity(self, idle: bool = True) -> None:
        """The merged KV outputs, then every worker's own connector state (KV tiers:
        kvtransfer/tiers/ranks.py); AssertionError naming the rank."""
        if self.failed is None:
            self._kv.check_integrity()
            for r in self.ask_workers(CMD_CHECK, REPLY_CHECK, idle) if self.check_ranks else []:
                if r.error:
                    raise AssertionError(r.error)

    # ---- failure -----------------------------------------------------------

    def _guard(self, fn: Any, *args: Any) -> Any:
        """Run a rank-0 call that joins collectives; a peer's death (or a
        collective timing out on a silent peer) becomes ``WorkerFailed``."""
        try:
            return fn(*args)
        except WorkerFailed:
            raise
        except RuntimeError as exc:
            # a dead peer's exit shows within 2 s; a stopped one's heartbeat
            # goes stale at most stale_after_s after the collective gave up
            wait_s = 2.0
            if self._started:
                wait_s += self.heartbeats.stale_after_s
            reason = self._worker_trouble(wait_s) or f"rank 0: {type(exc).__name__}: {exc}"
            raise self._fail(reason) from exc

    def _await(self, kind: int, timeout_s: float, step: int = 0) -> list[WorkerReply]:
        """One ``kind`` reply from every worker, polling their liveness meanwhile."""
        import zmq

        got: dict[int, WorkerReply] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.size - 1:
            if self._unread or self._replies.poll(_POLL_MS, zmq.POLLIN):
                if self._unread:
                    reply = self._unread.popleft()
                else:
                    reply = self._dec.decode(self._replies.recv())
                if reply.kind == REPLY_ERROR:
                    raise self._fail(reply.error or f"rank {reply.rank} failed")
                if reply.kind == kind and reply.step == step:
                    got[reply.rank] = reply
                continue
            self._check_alive()
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.size)) - set(got))
                raise self._fail(f"no reply from ranks {missing} within {timeout_s:.0f} s")
        return [got[r] for r in sorted(got)]

    def check_alive(self) -> None:
        """``WorkerFailed`` if the engine failed, a worker process exited, a
        worker sent an error or its heartbeat went stale (between steps)."""
        if self.failed is not None:
            raise WorkerFailed(self.failed)
        self._check_alive()

    def _check_alive(self) -> None:
        reason = self._worker_trouble(wait_s=0.0)
        if reason is not None:
            raise self._fail(reason)

    def _worker_trouble(self, wait_s: float) -> str | None:
        """A worker's error reply, exit or stale heartbeat, waiting up to
        ``wait_s`` for one to show (reading every reply meanwhile)."""
        import zmq

        deadline = time.monotonic() + wait_s
        error = None
        while True:
            while error is None and self._replies.poll(0, zmq.POLLIN):
                reply = self._dec.decode(self._replies.recv())
                if reply.kind == REPLY_ERROR:
                    error = reply.error or f"rank {reply.rank} failed"
                else:  # one ``_await`` is waiting for (it arrived after its poll)
                    self._unread.append(reply)
            # a silent rank first: its live peers' collectives time out too and
            # report that as their own error
            reason = self._stale() or error or first_exit(self.procs)
            if reason is not None or time.monotonic() >= deadline:
                return reason
            time.sleep(_POLL_MS / 1000)

    def _stale(self) -> str | None:
        """Ranks whose heartbeat is older than ``stale_after_s`` (they are
        killed first when the engine fails: a stopped process answers nothing)."""
        if not self._started:
            return None
        stale = {
            rank: age_s
            for rank, age_s in self.heartbeats.stale().items()
            if self.procs[rank - 1].exitcode is None  # an exit is reported as such
        }
        if not stale:
            return None
        self._unresponsive = sorted(stale)
        return "; ".join(
            f"rank {rank} (pid {self.procs[rank - 1].pid}) unresponsive: no heartbeat for "
            f"{age_s:.1f} s (tp_step_timeout_s={self.step_timeout_s:g})"
            for rank, age_s in sorted(stale.items())
        )

    def _fail(self, reason: str) -> WorkerFailed:
        self.failed = f"tensor-parallel engine failed: {reason}"
        logger.error("%s", self.failed)
        for rank in self._unresponsive:
            self.procs[rank - 1].kill()
        self.shutdown()
        return WorkerFailed(self.failed)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (a stop command, then terminate, then kill); idempotent."""
        with self._shutdown_lock:
            self._shutdown(timeout_s)

    def _shutdown(self, timeout_s: float) -> None:
        stop_workers(self._commands, self.procs, timeout_s)
        for sock in [*self._commands, self._replies]:
            sock.close()
        self._commands = []
        self.heartbeats.close()
        if not self._ctx.closed:
            self._ctx.term()


class TPRunner:
    """What the engine core steps instead of its ModelRunner when TP > 1."""

    def __init__(self, executor: TPExecutor, runner: Any) -> None:
        self.executor = executor
        self.runner = runner
        self.connector = runner.connector

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.executor.execute(self.runner, so)

    def release_idle_memory(self) -> None:
        """Called by the engine loop while idle: also notices a worker that died
        between steps (``WorkerFailed``), so a served engine fails, and is
        restarted, without waiting for its next request."""
        self.executor.check_alive()
        dense = self.runner.dense
        held = dense is not None and dense.capacity > 0
        self.runner.release_idle_memory()
        if held and dense.capacity == 0:
            self.executor.broadcast(CMD_RELEASE_IDLE)
