"""EngineService: one ``EngineCore`` served over the engine protocol's ZMQ
sockets (``wire/engine_protocol.py``), on the thread that calls ``serve_zmq``:

    gateway PUSH --[b"R", EngineRequest | b"A", EngineAbort | b"U", UtilityCall]--> engine PULL
    gateway PULL <--[b"O", EngineOutputs | b"U", UtilityResult | b"H", EngineHeartbeat]-- engine PUSH
                                                  (one PUSH per gateway: gateway_outputs.py)

That thread owns the engine: it steps it, answers utility calls, runs the
control calls other threads queue (``call_in_loop``), sends heartbeats,
holds outputs back while a gateway does not read (``output_sender.py``),

gateway that is gone with its requests (``gateway_outputs.py``).
"""

from __future__ import annotations

import logging
import os
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
    EngineOutput,
    UtilityCall,
    UtilityResult,
)
from tandem.wire.frames import FrameCounters, MalformedFrame, peer_address
from tandem.workers.engine.core import EngineCore
from tandem.workers.engine.gateway_sessions import GatewaySessions
from tandem.workers.engine.loop_wait import LoopWait
from tandem.workers.engine.profiling import EngineProfiler

logger = logging.getLogger(__name__)


class EngineService:
    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.config = engine.config
        self._shutdown = threading.Event()
        self._loop_running = False
        self.started = threading.Event()  # the loop runs with its first gateway registered
        self._control: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        # The loop's wake-up while it waits on its input: a pipe whose read end it polls
        # beside the input socket, written by ``call_in_loop`` and ``shutdown`` (any thread),
        # so an idle loop need not wake on a short timer to find their work. Open while
        # ``serve_zmq`` runs; the lock keeps a write off a closed (or reused) descriptor.
        self._wake_lock = threading.Lock()
        self._wake_fds: tuple[int, int] | None = None
        self.malformed_frames = FrameCounters()
        self._auth: Any = None  # wire.auth.PlaneAuth while serve_zmq runs
        self.sessions = GatewaySessions(engine)  # the gateways served, their requests
        self._enc = msgspec.msgpack.Encoder()
        self.profiler = EngineProfiler(
            self.config.output.profile_dir,
            self.config.runtime.engine_id,
            self.config.runtime.epoch,
            self.config.model.device,
        )
        # what a UtilityCall may call, by name (each runs on the loop thread)
        self._utilities: dict[str, Callable[..., Any]] = {
            "check_integrity": engine.check_integrity,
            "stats": self.stats,
            "gateways": self.gateways,
            "reset_prefix_cache": engine.reset_prefix_cache,
            "kv_transfer_address": engine.kv_transfer_address,
            "kv_rank_ports": engine.kv_rank_ports,
            "set_prefill_endpoints": engine.set_prefill_endpoints,
            "kv_tier_export": engine.kv_tier_export,
        }

    # ---- the loop ----------------------------------------------------------------

    def serve_zmq(
        self,
        input_addr: str,
        output_addr: str,
        *,
        bind_input: bool = True,
        gateway_session: int = 0,
    ) -> None:
        """Run until ``shutdown()``. Blocks on the input socket when idle, polls
        it without waiting while requests run, and briefly while only
        transfers are in flight (``workers/engine/loop_wait.py``). A malformed input
        message is dropped and counted (``wire.frames``); with
        ``config.runtime.cluster_secret`` both sockets use CURVE (``wire.auth``) and
        unauthenticated peers are refused. ``output_addr`` (may be empty:
        gateways ``join`` later) is the first gateway's, whose session is
        ``gateway_session``; each gateway gets its own output socket with a
        bounded send queue (``workers/engine/gateway_outputs.py``,
        ``output_sender.py``): while a connected gateway does not keep up
        the loop stops stepping, when its queue is full it stops reading
        input, and after ``output_stall_timeout_s`` it cuts that gateway's
        streams; a gateway that is gone is dropped with its requests."""
        import zmq

        from tandem.wire.auth import PlaneAuth
        from tandem.workers.engine.gateway_outputs import GatewayOutputs

        engine = self.engine
        ctx = zmq.Context()
        self._auth = auth = PlaneAuth(ctx, self.config.runtime.cluster_secret)
        inp = ctx.socket(zmq.PULL)
        inp.setsockopt(zmq.LINGER, 0)
        inp.setsockopt(zmq.MAXMSGSIZE, ENGINE_INPUT.hard_limit)
        if bind_input:
            auth.server(inp, ENGINE_INPUT.socket)
            inp.bind(input_addr)
        else:
            auth.client(inp)
            inp.connect(input_addr)

        def make_socket() -> Any:
            out = ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.LINGER, 1000)
            out.setsockopt(zmq.SNDHWM, self.config.output.hwm_messages)
            auth.client(out)
            return out

        sessions = self.sessions
        outs = sessions.outs = GatewayOutputs(
            make_socket,
            self.config.output.backlog_messages,
            self.config.output.gateway_lost_after_s,
        )
        if output_addr:
            outs.add(gateway_session, output_addr, default=True)
        poller = zmq.Poller()
        poller.register(inp, zmq.POLLIN)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        with self._wake_lock:
            self._wake_fds = (wake_r, wake_w)
        poller.register(wake_r, zmq.POLLIN)
        wait = LoopWait()
        enc = self._enc
        self._loop_running = True
        self.started.set()
        next_heartbeat_s = 0.0
        try:
            while not self._shutdown.is_set():
                if time.monotonic() >= next_heartbeat_s:
                    next_heartbeat_s = time.monotonic() + HEARTBEAT_INTERVAL_S
                    sessions.heartbeat(self.config.runtime.epoch)
                outs.poll_events()
                for link, why in outs.lost():
                    sessions.drop(link.session, why)
                if not outs.flush():
                    for link in outs.stalled(self.config.output.stall_timeout_s):
                        sessions.cut_streams(link)
                    if outs.full:  # read no input either: wait for the gateway
                        out_poller = zmq.Poller()
                        for sock in outs.blocked_sockets():
                            out_poller.register(sock, zmq.POLLOUT)
                        out_poller.poll(20)
                        self._run_control()
                        continue
                    timeout_ms = 5  # blocked: serve input, do not step
                else:
                    timeout_ms = wait.next_ms(engine.has_work(), engine.last_step_num_tokens > 0)
                events = dict(poller.poll(timeout_ms))
                if wake_r in events:
                    _drain(wake_r)
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
                        sessions.add_request(msg, errors)
                    elif kind == b"A":
                        engine.abort(msg.request_ids)
                    elif kind == b"U":
                        outs.send(outs.resolve(0), [b"U", enc.encode(self._utility(msg))])
                    events = dict(poller.poll(0))
                    wait.reset()
                if errors:
                    sessions.send_outputs(errors)
                if outs.blocked:
                    continue  # a gateway is behind: produce nothing new
                if engine.has_work():
                    outputs = engine.step()
                    if outputs.outputs:
                        sessions.send_outputs(outputs.outputs, outputs)
                        wait.reset()
                else:
                    if outs.owners:
                        outs.owners.clear()  # nothing runs: every request ended
                    engine.release_idle_memory()
        finally:
            self._loop_running = False
            with self._wake_lock:
                self._wake_fds = None
                os.close(wake_r)
                os.close(wake_w)
            self._run_control()
            if self.profiler.running:
                self.profiler.stop()
            inp.close()
            outs.close_all()
            auth.close()
            ctx.term()
            engine.release_step_resources()

    def shutdown(self) -> None:
        """Stop the loop (it releases the engine's step resources as it
        ends) and the engine's side services; from any thread."""
        self._shutdown.set()
        self._wake()
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
        self._wake()
        return fut.result(timeout_s)

    def _wake(self) -> None:
        """Wake the loop from its wait on the input (from any thread; a no-op when no
        loop runs). A full pipe already holds a wake-up, so that write is dropped."""
        with self._wake_lock:
            if self._wake_fds is not None:
                try:
                    os.write(self._wake_fds[1], b"\x01")
                except BlockingIOError:
                    pass

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
        sessions = self.sessions
        sender = sessions.outs
        return msgspec.structs.replace(
            stats,
            wire=self._wire_stats(stats.wire),
            output_backlog_messages=sender.backlog_len if sender is not None else 0,
            output_deferred_total=sender.num_deferred if sender is not None else 0,
            num_streams_cut=sessions.num_streams_cut,
            num_gateways=len(sender.links) if sender is not None else 0,
            num_gateways_lost=sessions.num_gateways_lost,
            num_gateway_requests_aborted=sessions.num_gateway_requests_aborted,
        )

    def _wire_stats(self, engine_wire: WireStats) -> WireStats:
        malformed = self.malformed_frames.snapshot()
        auth = self._auth.failures() if self._auth is not None else {}
        malformed.update(engine_wire.malformed_frames)
        auth.update(engine_wire.auth_failures)
        return WireStats(malformed_frames=malformed, auth_failures=auth)

    def check_integrity(self) -> bool:
        """The engine's invariants, and every request it holds has a
        registered gateway to send its outputs to."""
        self.engine.check_integrity()
        self.sessions.check_integrity()
        return True

    # ---- the gateways served (gateway_sessions.py): the engine actor's calls ------

    def gateways(self) -> list[int]:
        """The sessions of the gateways this engine serves."""
        return self.sessions.sessions()

    @property
    def serving(self) -> bool:
        """Its loop runs (it lists the gateways it serves); any thread."""
        return self._loop_running

    @property
    def gateway_sessions(self) -> tuple[int, ...]:
        """``gateways()`` from any thread (a snapshot the loop replaces)."""
        return self.sessions.snapshot

    def join_gateway(self, output_addr: str, session: int) -> bool:
        """Loop thread only (``call_in_loop``): ``GatewaySessions.join``."""
        return self.sessions.join(output_addr, session)

    def leave_gateway(self, session: int) -> int:
        """Loop thread only: gateway ``session`` stops (a normal exit); its
        requests are aborted. Returns how many."""
        return self.sessions.drop(session, "it left")

    def switch_gateway(self, output_addr: str, session: int = 0) -> int:
        """Loop thread only: ``GatewaySessions.switch``."""
        return self.sessions.switch(output_addr, session)


def _drain(fd: int) -> None:
    """Read every wake-up byte waiting in the (non-blocking) pipe."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
