"""The gateway's ZMQ data plane: requests out to each engine, outputs back.

    gateway                                   engines (Ray actors)
    PUSH per engine --EngineRequest/Abort-->  PULL (engine binds)
    PULL (bound here) <--EngineOutputs------  PUSH (every engine connects)

Both ZMQ directions are checked and, with a cluster secret, authenticated
(``wire/``): the output PULL is a CURVE server that admits only cluster
members, each engine PUSH a CURVE client; a malformed output message is
dropped and counted (``gateway_output``), never raised into the reader.

Every request in flight has one queue here (``open_stream``). The reader
puts ``(engine_id, EngineOutput)`` in it; an engine that fails puts
``(engine_id, EngineFailed)`` in the queue of each of its requests.

A client that stops reading stalls its response task in the HTTP send while
the reader keeps queueing its outputs: past ``max_queued_outputs`` undelivered
outputs the stream is cut (aborted on its engines, its queue dropped, the
task that consumes it cancelled, as a disconnect would), so gateway memory
per stream stays bounded and the engines stop computing for it.

The output reader is one task, supervised: if it ends, every stream in
flight gets an error output (and is aborted on its engines), ``reader_up``
is False (the backend is not ready), and the reader is restarted after a
backoff.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tandem.cluster.disagg.engine import Engine, ErrorLog
from tandem.cluster.engines.death_watch import DisconnectWatch
from tandem.cluster.gateway.backend import BackendUnavailable
from tandem.wire.auth import PlaneAuth
from tandem.wire.engine_protocol import GATEWAY_OUTPUT, EngineAbort
from tandem.wire.frames import FrameCounters, MalformedFrame, peer_address

logger = logging.getLogger(__name__)


class OutputStream:
    """One request's queue: ``(engine_id, EngineOutput | EngineFailed)`` in arrival
    order, for the one task that consumes it (``open_stream``).

    The part of ``asyncio.Queue``'s interface the backend uses, for one consumer and
    no bound: a put appends and wakes the consumer if it waits; a wait is one future.
    The reader puts every output of every stream and the consumer takes each, so
    this is on every streamed token's path; ``asyncio.Queue`` also keeps
    ``task_done`` counts, an event, and deques of getters and putters, which cost
    about 1 us per output here (docs/benchmarks.md, issue #29)."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: tuple[str, Any]) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> tuple[str, Any]:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> tuple[str, Any]:
        items = self._items
        while not items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return items.popleft()


@dataclass(frozen=True)
class EngineFailed:
    """Queued for each request of an engine that failed. ``lost``: a
    migration reason (``migration.REASON_*``) when the engine's work is gone
    and a decode stream may move on; None for a plain error."""

    message: str
    lost: str | None
    epoch: int


class DataPlane:
    def __init__(
        self,
        engines: dict[str, Engine],
        errors: ErrorLog,
        *,
        output_addr: str,
        cluster_secret: bytes | None,
        max_queued_outputs: int,
        reader_restart_delay_s: float,
        on_disconnect: Callable[[str, int], None],
        gateway_session: int = 0,
    ) -> None:
        """``on_disconnect(engine_id, epoch)``: an engine's input connection
        dropped (``cluster/engines/death_watch.py``). ``gateway_session``:
        this gateway's, the return address stamped on every request
        (``EngineRequest.gateway``: engines serve several gateways)."""
        self.gateway_session = gateway_session
        self.engines = engines
        self.errors = errors
        self.output_addr = output_addr
        self.max_queued_outputs = max_queued_outputs
        self.reader_restart_delay_s = reader_restart_delay_s
        self.ctx = zmq.asyncio.Context()
        self.auth = PlaneAuth(self.ctx, cluster_secret)
        self.malformed_frames = FrameCounters()
        self.streams: dict[str, OutputStream] = {}
        self.reader_task: asyncio.Task | None = None
        self.reader_up = False
        self.num_streams_cut = 0
        self.num_reader_restarts = 0
        self._pull: zmq.asyncio.Socket | None = None
        self._consumers: dict[str, asyncio.Task] = {}  # request id -> task iterating it
        self._enc = msgspec.msgpack.Encoder()
        self._disconnects = DisconnectWatch(on_disconnect)

    # ---- lifecycle -----------------------------------------------------------

    def start(self) -> asyncio.Task:
        """Bind the output socket; returns the reader's supervisor task."""
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, GATEWAY_OUTPUT.hard_limit)
        self.auth.server(self._pull, GATEWAY_OUTPUT.socket)
        self._pull.bind(self.output_addr)
        return asyncio.create_task(self._supervise_reader())

    def stop_watching(self) -> None:
        self._disconnects.close()

    def close_sockets(self) -> None:
        for e in self.engines.values():
            if e.socket is not None:
                e.socket.close(linger=0)
        if self._pull is not None:
            self._pull.close(linger=0)

    def terminate(self) -> None:
        """After every socket on ``ctx`` is closed (the routing's too)."""
        self.auth.close()
        self.ctx.term()

    # ---- engine inputs ---------------------------------------------------------

    def connect(self, e: Engine, input_addr: str, epoch: int) -> None:
        """A (new) incarnation's input socket, watched for a dropped connection."""
        if e.socket is not None:
            e.socket.close(linger=0)
        e.socket = self.ctx.socket(zmq.PUSH)
        e.socket.setsockopt(zmq.LINGER, 0)
        self.auth.client(e.socket)
        self._disconnects.watch(e.state.engine_id, epoch, e.socket)
        e.socket.connect(input_addr)

    def disconnect(self, e: Engine) -> None:
        """``e`` left the cluster: stop watching its connection, close its socket."""
        self._disconnects.unwatch(e.state.engine_id)
        if e.socket is not None:
            e.socket.close(linger=0)
            e.socket = None

    def send(self, e: Engine, kind: bytes, msg: Any) -> None:
        """Raises BackendUnavailable (not connected) or ``zmq.Again`` (its queue is full)."""
        if e.socket is None:
            raise BackendUnavailable(f"engine {e.state.engine_id} is not connected")
        if kind == b"R" and msg.gateway != self.gateway_session:
            msg = msgspec.structs.replace(msg, gateway=self.gateway_session)
        e.socket.send_multipart([kind, self._enc.encode(msg)], flags=zmq.NOBLOCK)

    def send_abort(self, e: Engine, request_ids: list[str]) -> None:
        """Never raises: an abort that cannot be queued now (engine not
        connected, its queue full) is kept as an orphan and sent once the
        engine is alive again."""
        try:
            self.send(e, b"A", EngineAbort(request_ids))
        except (BackendUnavailable, zmq.ZMQError):
            # e.g. its input queue is full (engine stalled behind its outputs);
            # retried at each health check, and its stall timeout ends them too
            logger.warning(
                "abort of %d requests not delivered to %s", len(request_ids), e.state.engine_id
            )
            e.health.orphans.update(request_ids)

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` on every engine holding it."""
        for e in self.engines.values():
            if request_id in e.requests:
                self.send_abort(e, [request_id])
                e.requests.discard(request_id)

    # ---- streams -----------------------------------------------------------------

    def open_stream(self, request_id: str) -> OutputStream:
        """The queue of ``request_id``'s outputs; the current task consumes it
        (cancelled if the stream is cut)."""
        q = OutputStream()
        self.streams[request_id] = q
        consumer = asyncio.current_task()
        if consumer is not None:
            self._consumers[request_id] = consumer
        return q

    def close_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self._consumers.pop(request_id, None)
        for e in self.engines.values():
            e.requests.discard(request_id)

    def fail_requests(self, e: Engine, reason: str, lost: str | None = None) -> None:
        """End every request in flight on ``e``. ``lost`` (a migration reason):
        the engine's work is gone, so a decode stream may migrate; None: a
        plain error (e.g. the gateway's own reader failed)."""
        failed = EngineFailed(reason, lost, e.state.epoch)
        for rid in list(e.requests):
            q = self.streams.get(rid)
            if q is not None:
                q.put_nowait((e.state.engine_id, failed))
        e.requests.clear()

    def fail_all(self, reason: str) -> None:
        """Every request in flight ends with an error and is aborted on its engines."""
        for e in self.engines.values():
            if e.requests:
                self.send_abort(e, list(e.requests))
            self.fail_requests(e, reason)

    def _cut(self, request_id: str) -> None:
        """The consumer of ``request_id`` is not keeping up: abort the request on
        its engines, drop its queue, cancel its consumer (as a disconnect)."""
        self.num_streams_cut += 1
        logger.warning(
            "request %s: %d outputs undelivered (client not reading); stream cut",
            request_id,
            self.max_queued_outputs,
        )
        self.abort(request_id)
        self.streams.pop(request_id, None)
        consumer = self._consumers.pop(request_id, None)
        if consumer is not None:
            consumer.cancel()

    # ---- the output reader ----------------------------------------------------------

    async def _supervise_reader(self) -> None:
        """Run the output reader; whenever it ends, fail the streams in flight
        and start it again after a backoff (``reader_up`` is False meanwhile)."""
        loop = asyncio.get_running_loop()
        num_quick_failures = 0
        try:
            while True:
                self.reader_task = asyncio.create_task(self._read_outputs())
                self.reader_up = True
                started_s = loop.time()
                await asyncio.wait([self.reader_task])
                self.reader_up = False
                task = self.reader_task
                cause = "cancelled" if task.cancelled() else repr(task.exception())
                if loop.time() - started_s > 30.0:
                    num_quick_failures = 0  # it had been working: back off from the start
                delay_s = min(self.reader_restart_delay_s * 2**num_quick_failures, 5.0)
                num_quick_failures += 1
                logger.error("output reader ended (%s); restarting in %.1f s", cause, delay_s)
                self.num_reader_restarts += 1
                self.errors.add("gateway", f"output reader ended ({cause}); restarted")
                self.fail_all(f"the gateway's output reader failed ({cause})")
                await asyncio.sleep(delay_s)
        finally:
            if self.reader_task is not None:
                self.reader_task.cancel()

    async def _read_outputs(self) -> None:
        assert self._pull is not None
        while True:
            frames = await self._pull.recv_multipart(copy=False)
            try:
                kind, batch = GATEWAY_OUTPUT.decode(frames)
            except MalformedFrame as e:
                self.malformed_frames.record(GATEWAY_OUTPUT.socket, peer_address(frames), e)
                continue
            if kind == b"H":
                engine = self.engines.get(batch.engine_id)
                if engine is not None:
                    engine.health.heartbeat(batch.epoch, batch.num_steps)
                continue
            if kind != b"O":
                continue
            for out in batch.outputs:
                q = self.streams.get(out.request_id)
                if q is not None:
                    if q.qsize() >= self.max_queued_outputs:
                        self._cut(out.request_id)
                    else:
                        q.put_nowait((batch.engine_id, out))
