"""EngineService: one ``EngineCore`` served over the engine protocol's ZMQ
sockets (``wire/engine_protocol.py``), on the thread that calls ``serve_zmq``:

    gateway PUSH --[b"R", EngineRequest | b"A", EngineAbort | b"U", UtilityCall]--> engine PULL
    gateway PULL <--[b"O", EngineOutputs | b"U", UtilityResult | b"H", EngineHeartbeat]-- engine PUSH

That thread owns the engine: it steps it, answers utility calls, runs the
control calls other threads queue (``call_in_loop``), sends heartbeats,
holds outputs back while the gateway does not read (``output_sender.py``)
and, told to, switches to a new gateway or cuts every stream.
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

from tandem.scheduler.engine_stats import EngineStats, WireStats
from tandem.wire.engine_protocol import (
    ENGINE_INPUT,
    HEARTBEAT_INTERVAL_S,
    EngineHeartbeat,
    EngineOutput,
    EngineOutputs,
    FinishReason,
    UtilityCall,
    UtilityResult,
)
from tandem.wire.frames import FrameCounters, MalformedFrame, peer_address
from tandem.workers.engine.core import EngineCore
from tandem.workers.engine.loop_wait import LoopWait

logger = logging.getLogger(__name__)


class EngineService:
    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.config = engine.config
        self._shutdown = threading.Event()
        self._loop_running = False
        self._control: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self.malformed_frames = FrameCounters()
        self._auth: Any = None  # wire.auth.PlaneAuth while serve_zmq runs
        self._output: Any = None  # the loop's OutputSender while serving
        self._output_addr = ""
        self.num_streams_cut = 0
        # what a UtilityCall may call, by name (each runs on the loop thread)
        self._utilities: dict[str, Callable[..., Any]] = {
            "check_integrity": engine.check_integrity,
            "stats": self.stats,
            "reset_prefix_cache": engine.reset_prefix_cache,
            "kv_transfer_address": engine.kv_transfer_address,
            "kv_rank_ports": engine.kv_rank_ports,
            "set_prefill_endpoints": engine.set_prefill_endpoints,
        }

    # ---- the loop ----------------------------------------------------------------

    def serve_zmq(self, input_addr: str, output_addr: str, *, bind_input: bool = True) -> None:
        """Run until ``shutdown()``. Blocks on the input socket when idle, polls
        it without waiting while requests run, and briefly while only
        transfers are in flight (``workers/engine/loop_wait.py``). A malformed input
        message is dropped and counted (``wire.frames``); with
        ``config.cluster_secret`` both sockets use CURVE (``wire.auth``) and
        unauthenticated peers are refused. Outputs go through a bounded send
        queue (``workers/engine/output_sender.py``): while the gateway does not keep
        up the loop stops stepping, when the queue is full it stops reading
        input, and after ``output_stall_timeout_s`` it cuts every stream."""
        import zmq

        from tandem.wire.auth import PlaneAuth
        from tandem.workers.engine.output_sender import OutputSender

        engine = self.engine
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
                    timeout_ms = wait.next_ms(engine.has_work(), engine.last_step_num_tokens > 0)
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
                        err = engine.add_request(msg)
                        if err is not None:
                            errors.append(err)
                    elif kind == b"A":
                        engine.abort(msg.request_ids)
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
                if engine.has_work():
                    outputs = engine.step()
                    if outputs.outputs:
                        sender.send([b"O", enc.encode(outputs)])
                        wait.reset()
                else:
                    engine.release_idle_memory()
        finally:
            self._loop_running = False
            self._run_control()
            inp.close()
            out.close()
            auth.close()
            ctx.term()
            engine.release_step_resources()

    def shutdown(self) -> None:
        """Stop the loop (it releases the engine's step resources as it
        ends) and the engine's side services; from any thread."""
        self._shutdown.set()
        self.engine.stop_side_services()
        if not self._loop_running:
            self.engine.release_step_resources()

    # ---- calls from other threads ----------------------------------------------

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
            self.engine.publish_kv_events()  # e.g. a prefix-cache reset

    def _utility(self, call: UtilityCall) -> UtilityResult:
        fn = self._utilities.get(call.method)
        if fn is None:
            return UtilityResult(call.call_id, error=f"unknown utility {call.method!r}")
        try:
            return UtilityResult(call.call_id, fn(*call.args))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, loop goes on
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    # ---- loop thread only ------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's stats with this service's: its sockets' dropped and
        refused messages, the output backlog and the streams cut."""
        stats = self.engine.stats()
        sender = self._output
        return msgspec.structs.replace(
            stats,
            wire=self._wire_stats(stats.wire),
            output_backlog_messages=sender.backlog_len if sender is not None else 0,
            output_deferred_total=sender.num_deferred if sender is not None else 0,
            num_streams_cut=self.num_streams_cut,
        )

    def _wire_stats(self, engine_wire: WireStats) -> WireStats:
        malformed = self.malformed_frames.snapshot()
        auth = self._auth.failures() if self._auth is not None else {}
        malformed.update(engine_wire.malformed_frames)
        auth.update(engine_wire.auth_failures)
        return WireStats(malformed_frames=malformed, auth_failures=auth)

    def switch_gateway(self, output_addr: str) -> int:
        """Loop thread only (``call_in_loop``): a new gateway adopted this
        engine (``cluster/engines/attach.py``). Every unfinished request belonged to
        the previous gateway, which can no longer receive its outputs: abort
        them all (their KV is freed), drop the outputs not yet sent, and send
        outputs to ``output_addr`` from now on (same socket, new peer).
        Returns the number of requests aborted."""
        ids = [r.request_id for r in self.engine.unfinished_requests()]
        if ids:
            self.engine.abort(ids)
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
        unfinished = self.engine.unfinished_requests()
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
        self.engine.abort(ids)
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
        """Its arrival is the gateway's proof that this loop runs."""
        import zmq

        beat = EngineHeartbeat(self.config.engine_id, self.config.epoch, self.engine.num_steps)
        try:
            out.send_multipart([b"H", enc.encode(beat)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the gateway is not reading; a lost heartbeat says the same
