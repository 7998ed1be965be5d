"""EngineService: one ``EngineCore`` served over the engine protocol's ZMQ
sockets (``wire/engine_protocol.py``), on the thread that calls ``serve_zmq``:

    gateway PUSH --[b"R", EngineRequest | b"A", EngineAbort | b"U", UtilityCall]--> engine PULL
    gateway PULL <--[b"O", EngineOutputs | b"U", UtilityResult | b"H", EngineHeartbeat]-- engine PUSH
                                                  (one PUSH per gateway: gateway_outputs.py)

That thread owns the engine: it steps it, answers utility calls, runs the
control calls other threads queue (``call_in_loop``), sends heartbeats,
holds outputs back while a gateway does not read (``output_sender.py``),
sends each output to the gateway that owns its request, and drops a
gateway that is gone with its requests (``gateway_outputs.py``).
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
    EngineRequest,
    FinishReason,
    UtilityCall,
    UtilityResult,
)
from tandem.wire.frames import FrameCounters, MalformedFrame, peer_address
from tandem.workers.engine.core import EngineCore
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
        self.malformed_frames = FrameCounters()
        self._auth: Any = None  # wire.auth.PlaneAuth while serve_zmq runs
        self._output: Any = None  # the loop's OutputSender while serving
        self._enc = msgspec.msgpack.Encoder()
        self.num_streams_cut = 0
        self.num_unroutable = 0  # requests naming a gateway that had not joined
        self.num_gateways_lost = 0  # gateways dropped because they were gone
        self.num_gateway_requests_aborted = 0  # requests of dropped gateways
        self.profiler = EngineProfiler(
            self.config.profile_dir, self.config.engine_id, self.config.epoch, self.config.device
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
        ``config.cluster_secret`` both sockets use CURVE (``wire.auth``) and
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
        self._auth = auth = PlaneAuth(ctx, self.config.cluster_secret)
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
            out.setsockopt(zmq.SNDHWM, self.config.output_hwm_messages)
            auth.client(out)
            return out

        outs = self._output = GatewayOutputs(
            make_socket, self.config.output_backlog_messages, self.config.gateway_lost_after_s
        )
        if output_addr:
            outs.add(gateway_session, output_addr, default=True)
        poller = zmq.Poller()
        poller.register(inp, zmq.POLLIN)
        wait = LoopWait()
        enc = self._enc
        self._loop_running = True
        self.started.set()
        next_heartbeat_s = 0.0
        try:
            while not self._shutdown.is_set():
                if time.monotonic() >= next_heartbeat_s:
                    next_heartbeat_s = time.monotonic() + HEARTBEAT_INTERVAL_S
                    self._send_heartbeat()
                outs.poll_events()
                for link, why in outs.lost():
                    self.drop_gateway(link.session, why)
                if not outs.flush():
                    for link in outs.stalled(self.config.output_stall_timeout_s):
                        self._cut_streams(link)
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
                        self._add_request(msg, errors)
                    elif kind == b"A":
                        engine.abort(msg.request_ids)
                    elif kind == b"U":
                        outs.send(outs.resolve(0), [b"U", enc.encode(self._utility(msg))])
                    events = dict(poller.poll(0))
                    wait.reset()
                if errors:
                    self._send_outputs(errors)
                if outs.blocked:
                    continue  # a gateway is behind: produce nothing new
                if engine.has_work():
                    outputs = engine.step()
                    if outputs.outputs:
                        self._send_outputs(outputs.outputs, outputs)
                        wait.reset()
                else:
                    if outs.owners:
                        outs.owners.clear()  # nothing runs: every request ended
                    engine.release_idle_memory()
        finally:
            self._loop_running = False
            self._run_control()
            if self.profiler.running:
                self.profiler.stop()
            inp.close()
            outs.close_all()
            auth.close()
            ctx.term()
            engine.release_step_resources()

    def _add_request(self, req: EngineRequest, errors: list[EngineOutput]) -> None:
        """Queue ``req`` for the gateway it names (its return address)."""
        outs = self._output
        if outs.own(req.request_id, req.gateway) is None:
            self.num_unroutable += 1
            logger.warning(
                "engine %s: request %s names gateway %d, which has not joined; dropped",
                self.config.engine_id,
                req.request_id,
                req.gateway,
            )
            return
        err = self.engine.add_request(req)
        if err is not None:
            errors.append(err)

    def _send_outputs(
        self, outputs: list[EngineOutput], batch: EngineOutputs | None = None
    ) -> None:
        """Each output to the gateway that owns its request: one message per
        gateway (the whole batch when one gateway owns them all)."""
        outs = self._output
        engine_id = self.config.engine_id
        owners = outs.owners
        finished = False
        by_gateway: dict[int | None, list[EngineOutput]] = {}
        for out in outputs:
            by_gateway.setdefault(owners.get(out.request_id), []).append(out)
            if out.finish_reason is not None:
                finished = True
        for session, group in by_gateway.items():
            if session is None:
                continue  # its gateway is gone
            if batch is not None and len(by_gateway) == 1:
                msg = batch
            else:
                msg = EngineOutputs(
                    engine_id, group, time.time(), batch.scheduler_stats if batch else None
                )
            outs.send(session, [b"O", self._enc.encode(msg)])
        if finished:
            outs.prune(self._live_client_ids())

    def _live_client_ids(self) -> set[str]:
        return {r.parent_id or r.request_id for r in self.engine.unfinished_requests()}

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
            num_gateways=len(sender.links) if sender is not None else 0,
            num_gateways_lost=self.num_gateways_lost,
            num_gateway_requests_aborted=self.num_gateway_requests_aborted,
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
        if self._output is not None:
            self._output.check_integrity(self._live_client_ids())
        return True

    def gateways(self) -> list[int]:
        """The sessions of the gateways this engine serves."""
        return self._output.sessions() if self._output is not None else []

    @property
    def gateway_sessions(self) -> tuple[int, ...]:
        """``gateways()`` from any thread (a snapshot the loop replaces)."""
        return self._output.session_snapshot if self._output is not None else ()

    def join_gateway(self, output_addr: str, session: int) -> bool:
        """Loop thread only (``call_in_loop``): gateway ``session`` serves
        from this engine too; its requests' outputs go to ``output_addr``.
        The other gateways keep their requests. False if it had joined.
        A gone gateway whose address the new one reuses (a port freed and
        taken again) is dropped first: its connection would look alive."""
        for link in list(self._output.links.values()):
            if link.addr == output_addr and link.session != session:
                self.drop_gateway(link.session, "a new gateway took its address")
        return self._output.add(session, output_addr)

    def leave_gateway(self, session: int) -> int:
        """Loop thread only: gateway ``session`` stops (a normal exit); its
        requests are aborted. Returns how many."""
        return self.drop_gateway(session, "it left")

    def switch_gateway(self, output_addr: str, session: int = 0) -> int:
        """Loop thread only: the gateway at ``output_addr`` becomes this
        engine's only one. Every other gateway is dropped with its requests
        (their KV freed, their held outputs discarded). Returns the number
        of requests aborted."""
        num = sum(self.drop_gateway(s, "replaced") for s in self.gateways())
        self._output.add(session, output_addr, default=True)
        return num

    def drop_gateway(self, session: int, why: str) -> int:
        """Loop thread only: forget gateway ``session``; abort the requests
        it owns (nothing would read their outputs). Returns how many."""
        outs = self._output
        if outs is None or session not in outs.links:
            return 0
        owned = set(outs.requests_of(session))
        ids = [
            r.request_id
            for r in self.engine.unfinished_requests()
            if (r.parent_id or r.request_id) in owned
        ]
        if ids:
            self.engine.abort(ids)
        outs.close(session)
        self.num_gateways_lost += why != "it left" and why != "replaced"
        self.num_gateway_requests_aborted += len(owned)
        logger.log(
            logging.INFO if why == "it left" else logging.WARNING,
            "engine %s: gateway %d dropped (%s): %d requests aborted",
            self.config.engine_id,
            session,
            why,
            len(owned),
        )
        return len(ids)

    def _cut_streams(self, link: Any) -> None:
        """Gateway ``link`` read nothing for ``output_stall_timeout_s``: end
        every unfinished request it owns with an error (freeing its KV) and
        queue one error output for them, so that gateway learns why if it
        comes back. The other gateways' requests go on."""
        sender = link.sender
        stall_s = sender.stalled_s
        owned = set(self._output.requests_of(link.session))
        unfinished = [
            r for r in self.engine.unfinished_requests() if (r.parent_id or r.request_id) in owned
        ]
        ids = [r.request_id for r in unfinished]
        client_ids = list(dict.fromkeys(r.parent_id or r.request_id for r in unfinished))
        self.num_streams_cut += len(client_ids)
        sender.reset_stall()
        if not ids:
            return
        logger.warning(
            "engine %s: gateway %d read no output for %.0f s: cutting %d streams",
            self.config.engine_id,
            link.session,
            stall_s,
            len(ids),
        )
        self.engine.abort(ids)
        self._output.forget(client_ids)
        message = f"engine {self.config.engine_id}: outputs not read for {stall_s:.0f} s"
        errors = [
            EngineOutput(request_id=rid, finish_reason=FinishReason.ERROR, error=message)
            for rid in client_ids  # a fork's children: one error for the client's request
        ]
        sender.send(
            [b"O", self._enc.encode(EngineOutputs(self.config.engine_id, errors, time.time()))]
        )

    def _send_heartbeat(self) -> None:
        """Its arrival is each gateway's proof that this loop runs."""
        beat = EngineHeartbeat(self.config.engine_id, self.config.epoch, self.engine.num_steps)
        self._output.send_all_nowait([b"H", self._enc.encode(beat)])
