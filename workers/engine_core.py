"""EngineCore: one engine's loop, ``schedule() -> execute() -> update_from_output()``.

In-process use: ``add_request`` / ``abort`` / ``step``. As a service,
``serve_zmq`` feeds the loop from a ZMQ PULL socket and pushes
``EngineOutputs`` to the gateway:

    gateway PUSH --[b"R", EngineRequest | b"A", EngineAbort | b"U", UtilityCall]--> engine PULL
    gateway PULL <--[b"O", EngineOutputs | b"U", UtilityResult]------------------- engine PUSH
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import torch

from kvtransfer.ucx.proto_info import stats_fields as transport_fields
from scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from scheduler.async_scheduler import AsyncScheduler
from scheduler.engine_stats import EngineStats, Histogram, KVTransferStats, WireStats
from scheduler.kv_events import KVEventRecorder, KVSnapshot
from wire.engine_protocol import (
    ENGINE_INPUT,
    HEARTBEAT_INTERVAL_S,
    EngineHeartbeat,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    FinishReason,
    UtilityCall,
    UtilityResult,
)
from wire.frames import FrameCounters, MalformedFrame, peer_address
from workers.async_step import OverlappedLoop
from workers.compile.model import compile_before_sizing
from workers.config import EngineConfig
from workers.graphs.build import build_step_graphs
from workers.graphs.memory import profile_step_memory
from workers.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for
from workers.kv_events_publisher import KVEventPublisher
from workers.loader import end_token_ids, load_model, resolve_model_path
from workers.loop_wait import LoopWait
from workers.model_runner import ModelRunner
from workers.request_clock import RequestClock

logger = logging.getLogger(__name__)

MAX_DEFAULT_MODEL_LEN = 4096


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        device = torch.device(config.device)
        self.model_path = resolve_model_path(config.model)
        self.tp: Any = None  # workers.parallel.executor.TPExecutor with TP > 1
        if config.tensor_parallel_size > 1:  # this process is rank 0 (workers/parallel/)
            from workers.parallel.executor import TPExecutor

            self.tp = TPExecutor(config, self.model_path)
            self.model, self.hf_config = self.tp.model, self.tp.hf_config
        else:
            self.model, self.hf_config = load_model(self.model_path, config.dtype, device)
        m = self.model
        self.dtype = next(m.parameters()).dtype
        eos_ids = end_token_ids(self.hf_config)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self.extra_eos_ids = eos_ids[1:]
        max_len = config.max_model_len or min(m.max_context_len, MAX_DEFAULT_MODEL_LEN)
        if max_len > m.max_context_len:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's context length {m.max_context_len}"
            )
        self.max_model_len = max_len
        block_bytes = bytes_per_block(
            m.num_layers, config.block_size, m.num_kv_heads, m.head_dim, self.dtype
        )
        # workers/compile/: torch.compile of the forward, first, so that the profile below
        # measures the forward the engine runs (the compiled graphs hold no cache)
        self.compile_report = compile_before_sizing(config, m)
        # activation peak and CUDA graphs, measured to come out of the KV budget (CUDA only)
        self.step_memory = profile_step_memory(config, m, max_len)
        num_blocks = num_blocks_for(
            block_bytes=block_bytes,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            device=device,
            step_bytes=self.step_memory.num_bytes,
        )
        if self.tp is not None:
            num_blocks = self.tp.agree_num_blocks(num_blocks)
        if config.max_model_len is None:
            # Default: the model's length, but never more than the cache holds.
            self.max_model_len = max_len = min(max_len, num_blocks * config.block_size)
        self.kv_cache = allocate_kv_cache(
            num_blocks,
            m.num_layers,
            config.block_size,
            m.num_kv_heads,
            m.head_dim,
            self.dtype,
            device,
            layout=config.kv_layout,
        )
        self.sched_config = SchedulerConfig(
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_caching_hash_algo=config.prefix_caching_hash_algo,
            policy=config.policy,
            kv_admission_margin=config.kv_admission_margin,
            max_num_partial_prefills=config.max_num_partial_prefills,
            max_long_partial_prefills=config.max_long_partial_prefills,
            load_failure_policy=config.load_failure_policy,
        )
        self.connector_scheduler, self.connector_worker = self._make_connector()
        # overlapped loop (workers/async_step.py); TP ranks step in lockstep: synchronous
        overlap = config.uses_async_scheduling() and self.tp is None
        scheduler_cls = AsyncScheduler if overlap else Scheduler
        self.scheduler = scheduler_cls(
            self.sched_config, self.connector_scheduler, config.engine_id
        )
        self.kv_events: KVEventRecorder | None = None
        self.kv_publisher: KVEventPublisher | None = None
        if config.kv_events:  # scheduler/kv_events.py: only when routing needs them
            self.kv_events = KVEventRecorder(config.engine_id, config.epoch, config.block_size)
            self.scheduler.kv.pool.events = self.kv_events
            self.kv_publisher = KVEventPublisher(
                config.kv_host,
                config.kv_events_port,
                config.cluster_secret,
                config.kv_events_queue_batches,
            )
        self.graphs = graphs = build_step_graphs(
            config, self.model, self.kv_cache, max_len, self.step_memory.graph_bytes
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            config.block_size,
            self.eos_token_id,
            connector=self.connector_worker,
            seed=config.seed,
            dense_decode_bytes=config.dense_decode_bytes,
            decode_graphs=graphs.decode,
            piecewise_graphs=graphs.piecewise,
            prefill_attention=config.prefill_attention,
            overlap=overlap,
        )
        self.overlap = OverlappedLoop(self.scheduler, self.runner) if overlap else None
        if self.tp is not None:
            self.runner = self.tp.start(self.runner)
        self._shutdown = threading.Event()
        self.num_steps = 0
        self.last_step_s = 0.0
        self._transfer_seconds = Histogram(
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
        )
        self.request_clock = RequestClock(config.engine_id, config.epoch, config.role)
        self._loop_running = False
        self.malformed_frames = FrameCounters()
        self._auth: Any = None  # wire.auth.PlaneAuth while serve_zmq runs
        self._output: Any = None  # the loop's OutputSender while serving
        self.last_step_num_tokens = 0
        self.num_streams_cut = 0
        self._control: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()

    def _make_connector(self):
        if not self.config.kv_connector:
            return None, None
        from kvtransfer.registry import create_connector
        from workers.parallel.connector_hook import kv_transfer_config

        return create_connector(kv_transfer_config(self.config, self.hf_config))

    # ---- in-process API ------------------------------------------------------

    def add_request(self, req: EngineRequest) -> EngineOutput | None:
        """Queue a request; on bad input return an error output instead of raising."""
        try:
            sp = req.sampling_params
            if self.extra_eos_ids:
                sp = msgspec.structs.replace(
                    sp, stop_token_ids=list(sp.stop_token_ids) + self.extra_eos_ids
                )
            request = Request.from_engine_request(req, self.eos_token_id)
            request.sampling_params = sp
            vocab = self.model.vocab_size
            bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(
                    f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab})"
                )
            self.scheduler.add_request(request)
            self.request_clock.received(req.request_id)
        except ValueError as exc:
            return EngineOutput(
                request_id=req.request_id, finish_reason=FinishReason.ERROR, error=str(exc)
            )
        return None

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.request_clock.forget(request_ids)

    def step(self) -> EngineOutputs:
        self.num_steps += 1
        start_s = step_start = self.request_clock.clock()
        if self.overlap is not None:
            so, outputs = self.overlap.step()
        else:
            so = self.scheduler.schedule()
            outputs = self.scheduler.update_from_output(so, self.runner.execute(so))
        self.last_step_num_tokens = so.total_num_scheduled_tokens
        self.last_step_s = time.perf_counter() - start_s
        drain = getattr(self.connector_worker, "drain_load_records", None)
        self.request_clock.after_step(
            step_start,
            so,
            outputs.outputs,
            self.scheduler.waiting_for_remote,
            drain() if drain is not None else (),
        )
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        """Send the cache changes since the last call as one batch (loop thread)."""
        if self.kv_events is not None and self.kv_publisher is not None:
            batch = self.kv_events.drain(time.time())
            if batch is not None:
                self.kv_publisher.publish(batch)

    def kv_events_snapshot(self) -> KVSnapshot:
        """Every cached hash as of the last batch published (loop thread):
        a subscriber that saw a seq gap resyncs from this."""
        if self.kv_events is None:
            raise ValueError(f"engine {self.config.engine_id} runs without kv_events")
        self.publish_kv_events()
        return self.kv_events.snapshot(list(self.scheduler.kv.pool.cached))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def check_integrity(self) -> bool:
        self.scheduler.check_integrity()
        if self.tp is not None:
            self.tp.check_integrity()
        self.request_clock.check_integrity(self.scheduler.requests)
        return True

    def stats(self) -> EngineStats:
        """This engine now (``scheduler/engine_stats.py``). Loop thread only
        (``call_in_loop``)."""
        sender = self._output
        kv = self._kv_stats() if self.connector_worker is not None else None
        return EngineStats(
            engine_id=self.config.engine_id,
            role=self.config.role,
            epoch=self.config.epoch,
            num_steps=self.num_steps,
            last_step_s=self.last_step_s,
            scheduler=self.scheduler.make_stats(),
            num_transfers_in_flight=kv.loads_in_flight if kv is not None else 0,
            kv_transfer=kv,
            wire=self.wire_stats(),
            output_backlog_messages=sender.backlog_len if sender is not None else 0,
            output_deferred_total=sender.num_deferred if sender is not None else 0,
            num_streams_cut=self.num_streams_cut,
        )

    def wire_stats(self) -> WireStats:
        """Dropped malformed messages and refused handshakes per socket name,
        of this engine's sockets and its connector's side channel."""
        malformed = self.malformed_frames.snapshot()
        auth = self._auth.failures() if self._auth is not None else {}
        connector = getattr(self.connector_worker, "wire_stats", None)
        if connector is not None:
            extra = connector()
            malformed.update(extra["malformed_frames"])
            auth.update(extra["auth_failures"])
        return WireStats(malformed_frames=malformed, auth_failures=auth)

    def _kv_stats(self) -> KVTransferStats:
        w = self.connector_worker
        raw = w.stats()
        if self.tp is not None:  # bytes and descriptors of every rank's reads
            raw = self.tp.sum_kv_stats(raw)
        for seconds in w.drain_transfer_seconds():
            self._transfer_seconds.observe(seconds)
        return KVTransferStats(
            transfer_bytes_total=raw.get("kv_transfer_bytes_total", 0.0),
            transfer_descriptors_total=raw.get("num_descriptors", 0.0),
            transfer_failures_total=raw.get("num_failures", 0.0),
            notification_failures_total=raw.get("num_notif_failures", 0.0),
            lease_expiries_total=raw.get("num_lease_expiries", 0.0),
            quarantined_loads_total=raw.get("num_quarantined_loads_total", 0.0),
            loads_in_flight=int(raw.get("num_loads_in_flight", 0)),
            loads_in_quarantine=int(raw.get("num_loads_quarantined", 0)),
            sends_blocks_held=int(raw.get("num_blocks_held_for_transfer", 0)),
            transfer_seconds=self._transfer_seconds.snapshot(),
            **transport_fields(getattr(w, "transport_report", lambda: None)()),
        )

    def set_prefill_endpoints(self, endpoints: list[Any]) -> bool:
        """The prefill engines this engine may read KV from, as the cluster
        registered them: ``[engine_id, epoch, host, port]`` each, the whole
        list every time (``kvtransfer/prefill_registry.py``). Loop thread only
        (``call_in_loop``). Raises ``ValueError`` on a bad entry."""
        setter = getattr(self.connector_scheduler, "set_prefill_endpoints", None)
        if setter is None:
            raise ValueError(f"engine {self.config.engine_id} has no KV connector that reads")
        setter(endpoints)
        return True

    def kv_transfer_address(self) -> tuple[str, int] | None:
        if self.connector_worker is None or not self.connector_worker.side_channel_port:
            return None
        return (self.config.kv_host, self.connector_worker.side_channel_port)

    def kv_rank_ports(self) -> list[int]:
        """Every tensor-parallel rank's side-channel port, rank 0's first
        (``[]`` with one rank or no side channel): a prefill endpoint's ``rank_ports``."""
        address = self.kv_transfer_address()
        if self.tp is None or address is None:
            return []
        return [address[1], *self.tp.worker_kv_ports]

    def call_in_loop(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """Run ``fn`` on the engine loop thread between steps (scheduler state
        is owned by that thread); directly when no loop is running."""
        if not self._loop_running:
            return fn()
        fut: Future = Future()
        self._control.put((fn, fut))
        return fut.result(timeout_s)

    def _run_control(self) -> None:
        while True:
            try:
                fn, fut = self._control.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            self.publish_kv_events()  # e.g. a prefix-cache reset

    def shutdown(self) -> None:
        self._shutdown.set()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.tp is not None and not self._loop_running:
            self.tp.shutdown()  # else the loop thread does, as it ends (it owns the sockets)
        if self.overlap is not None and not self._loop_running:
            self.runner.close()  # else the loop thread does, as it ends

    # ---- ZMQ service loop ------------------------------------------------------

    def serve_zmq(self, input_addr: str, output_addr: str, *, bind_input: bool = True) -> None:
        """Run until ``shutdown()``. Blocks on the input socket when idle, polls
        it without waiting while requests run, and briefly while only
        transfers are in flight (``workers/loop_wait.py``). A malformed input
        message is dropped and counted (``wire.frames``); with
        ``config.cluster_secret`` both sockets use CURVE (``wire.auth``) and
        unauthenticated peers are refused. Outputs go through a bounded send
        queue (``workers/output_sender.py``): while the gateway does not keep
        up the loop stops stepping, when the queue is full it stops reading
        input, and after ``output_stall_timeout_s`` it cuts every stream."""
        import zmq

        from wire.auth import PlaneAuth
        from workers.output_sender import OutputSender

        ctx = zmq.Context()
        self._auth = auth = PlaneAuth(ctx, self.config.cluster_secret)
        inp = ctx.socket(zmq.PULL)
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 1000)
        out.setsockopt(zmq.SNDHWM, self.config.output_hwm_messages)
        inp.setsockopt(zmq.LINGER, 0)
        inp.setsockopt(zmq.MAXMSGSIZE, ENGINE_INPUT.hard_limit)
        if bind_input:
            auth.server(inp, ENGINE_INPUT.socket)
            inp.bind(input_addr)
        else:
            auth.client(inp)
            inp.connect(input_addr)
        auth.client(out)
        out.connect(output_addr)
        self._output_addr = output_addr
        sender = self._output = OutputSender(out, self.config.output_backlog_messages)
        poller = zmq.Poller()
        poller.register(inp, zmq.POLLIN)
        out_poller = zmq.Poller()
        out_poller.register(out, zmq.POLLOUT)
        wait = LoopWait()
        enc = msgspec.msgpack.Encoder()
        self._loop_running = True
        next_heartbeat_s = 0.0
        try:
            while not self._shutdown.is_set():
                if time.monotonic() >= next_heartbeat_s:
                    next_heartbeat_s = time.monotonic() + HEARTBEAT_INTERVAL_S
                    self._send_heartbeat(out, enc)
                if not sender.flush():
                    if sender.stalled_s > self.config.output_stall_timeout_s:
                        self._cut_streams(sender)
                    if sender.full:  # read no input either: wait for the gateway
                        out_poller.poll(20)
                        self._run_control()
                        continue
                    timeout_ms = 5  # blocked: serve input, do not step
                else:
                    timeout_ms = wait.next_ms(self.has_work(), self.last_step_num_tokens > 0)
                events = dict(poller.poll(timeout_ms))
                self._run_control()
                errors: list[EngineOutput] = []
                while inp in events:
                    frames = inp.recv_multipart(copy=False)
                    try:
                        kind, msg = ENGINE_INPUT.decode(frames)
                    except MalformedFrame as e:
                        self.malformed_frames.record(ENGINE_INPUT.socket, peer_address(frames), e)
                        kind = b""
                    if kind == b"R":
                        err = self.add_request(msg)
                        if err is not None:
                            errors.append(err)
                    elif kind == b"A":
                        self.abort(msg.request_ids)
                    elif kind == b"U":
                        sender.send([b"U", enc.encode(self._utility(msg))])
                    events = dict(poller.poll(0))
                    wait.reset()
                if errors:
                    sender.send(
                        [
                            b"O",
                            enc.encode(EngineOutputs(self.config.engine_id, errors, time.time())),
                        ]
                    )
                if sender.blocked:
                    continue  # the gateway is behind: produce nothing new
                if self.has_work():
                    outputs = self.step()
                    if outputs.outputs:
                        sender.send([b"O", enc.encode(outputs)])
                        wait.reset()
                else:
                    self.runner.release_idle_memory()
        finally:
            self._loop_running = False
            self._run_control()
            inp.close()
            out.close()
            auth.close()
            ctx.term()
            if self.tp is not None:
                self.tp.shutdown()
            if self.overlap is not None:
                self.runner.close()

    def switch_gateway(self, output_addr: str) -> int:
        """Loop thread only (``call_in_loop``): a new gateway adopted this
        engine (``cluster/attach.py``). Every unfinished request belonged to
        the previous gateway, which can no longer receive its outputs: abort
        them all (their KV is freed), drop the outputs not yet sent, and send
        outputs to ``output_addr`` from now on (same socket, new peer).
        Returns the number of requests aborted."""
        ids = [r.request_id for r in self.scheduler.requests.values() if not r.is_finished]
        if ids:
            self.abort(ids)
        self._output.discard()
        sock = self._output.socket
        sock.disconnect(self._output_addr)
        sock.connect(output_addr)
        self._output_addr = output_addr
        return len(ids)

    def _cut_streams(self, sender: Any) -> None:
        """The gateway read nothing for ``output_stall_timeout_s``: end every
        unfinished request with an error (freeing its KV) and queue one
        error output for them, so a gateway that comes back learns why."""
        stall_s = sender.stalled_s
        unfinished = [r for r in self.scheduler.requests.values() if not r.is_finished]
        ids = [r.request_id for r in unfinished]
        client_ids = list(dict.fromkeys(r.parent_id or r.request_id for r in unfinished))
        self.num_streams_cut += len(client_ids)
        sender.reset_stall()
        if not ids:
            return
        logger.warning(
            "engine %s: gateway read no output for %.0f s: cutting %d streams",
            self.config.engine_id,
            stall_s,
            len(ids),
        )
        self.abort(ids)
        message = f"engine {self.config.engine_id}: outputs not read for {stall_s:.0f} s"
        errors = [
            EngineOutput(request_id=rid, finish_reason=FinishReason.ERROR, error=message)
            for rid in client_ids  # a fork's children: one error for the client's request
        ]
        sender.send(
            [
                b"O",
                msgspec.msgpack.encode(EngineOutputs(self.config.engine_id, errors, time.time())),
            ]
        )

    def _send_heartbeat(self, out: Any, enc: msgspec.msgpack.Encoder) -> None:
        """Loop thread only: its arrival is the gateway's proof that this loop runs."""
        import zmq

        beat = EngineHeartbeat(self.config.engine_id, self.config.epoch, self.num_steps)
        try:
            out.send_multipart([b"H", enc.encode(beat)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the gateway is not reading; a lost heartbeat says the same

    def _utility(self, call: UtilityCall) -> UtilityResult:
        allowed = {
            "check_integrity",
            "stats",
            "reset_prefix_cache",
            "kv_transfer_address",
            "kv_rank_ports",
            "set_prefill_endpoints",
        }
        if call.method not in allowed:
            return UtilityResult(call.call_id, error=f"unknown utility {call.method!r}")
        try:
            if call.method == "reset_prefix_cache":
                done = self.scheduler.reset_prefix_cache()
                self.publish_kv_events()
                return UtilityResult(call.call_id, done)
            return UtilityResult(call.call_id, getattr(self, call.method)(*call.args))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, loop goes on
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")
