"""The production backend: Ray engine pools behind a ZMQ data plane.

    gateway                                   engines (Ray actors)
    PUSH per engine --EngineRequest/Abort-->  PULL (engine binds)
    PULL (bound here) <--EngineOutputs------  PUSH (every engine connects)

Disaggregated request (ARCHITECTURE §2):

    P <- prompt, max_tokens=1, {do_remote_decode}
    P -> first token + kv_transfer_params      -> streamed to the client at once
    D <- prompt + first token, max_tokens-1, P's params + {do_remote_prefill}
    D -> tokens ...                            -> streamed

Both ZMQ directions are checked and, with a cluster secret, authenticated
(``wire/``): the output PULL is a CURVE server that admits only cluster
members, each engine PUSH a CURVE client; a malformed output message is
dropped and counted (``gateway_output``), never raised into the reader.

Health (``cluster/engines/health.py``): engines send heartbeats from their
loop threads on the output socket; a health task also calls ``ready`` over
Ray. A slow engine (no recent heartbeat, Ray calls timing out) keeps its
requests. A dead one (its process exited: ``cluster/engines/death_watch.py``
confirms a dropped input connection within milliseconds; Ray says the
actor died; or no heartbeat for ``engine_dead_after_s``) fails its in-flight
requests (prefill: retried once on another prefill engine, else prefilled on
the decode engine; decode: migrated, or an error output); they stay its
orphans, aborted on it if the same incarnation comes back. A restarted one (new epoch) is reconnected and
marked ready.

A client that stops reading stalls its response task in the HTTP send while
the reader keeps queueing its outputs: past ``max_queued_outputs`` undelivered
outputs the stream is cut (aborted on its engines, its queue dropped, the
task that consumes it cancelled, as a disconnect would), so gateway memory
per stream stays bounded and the engines stop computing for it.

Migration (``cluster/disagg/migration.py``): a decode or colocated engine declared
DEAD, restarted or drained does not end its streams with an error; each one
is resubmitted (prompt + every token already sent) to another ready engine
of the pool, and the client's stream continues token-identical. A prefill
engine's failure is handled as before (retry, else prefill on D).

Drain (``drain``): the engine gets no new work, its streams migrate away,
and it stays connected and idle until ``undrain``.

The output reader is one task, supervised: if it ends, every stream in
flight gets an error output (and is aborted on its engines), ``is_ready``
says no, and the reader is restarted after a backoff.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from cluster.disagg.migration import (
    REASON_DEAD,
    REASON_DRAIN,
    REASON_RESTARTED,
    EngineLost,
    MigrationPolicy,
    StreamLedger,
)
from cluster.engines.death_watch import DisconnectWatch, confirm_exit, process_gone
from cluster.engines.health import EngineHealth, Liveness
from cluster.engines.pools import EngineHandle
from cluster.engines.prefill_endpoints import push_prefill_endpoints
from cluster.gateway.backend import (
    Backend,
    BackendMetrics,
    BackendUnavailable,
    EngineMetrics,
    ErrorEvent,
)
from cluster.routing.cluster_routing import ClusterRouting, PromptHashes
from cluster.routing.policy import Choice, RoutingConfig
from cluster.routing.router import EngineState, Router
from kvtransfer.handoff import decode_request, prefill_request
from scheduler.engine_stats import STATS_DECODER, EngineStats
from scheduler.fork import child_request_id
from wire.auth import PlaneAuth
from wire.engine_protocol import (
    GATEWAY_OUTPUT,
    EngineAbort,
    EngineOutput,
    EngineRequest,
    FinishReason,
)
from wire.frames import FrameCounters, MalformedFrame, decode, peer_address

logger = logging.getLogger(__name__)

_ENGINE_FAILED = "__engine_failed__"
# an engine whose stats show none of these holds no request (drain: idle)
_BUSY_STATS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_for_remote_kvs",
    "num_blocks_held_for_transfer",
)


class _Engine:
    def __init__(self, handle: EngineHandle, state: EngineState, health: EngineHealth) -> None:
        self.handle = handle
        self.state = state
        self.health = health
        self.socket: zmq.asyncio.Socket | None = None
        self.requests: set[str] = set()  # request ids in flight here
        self.stats: EngineStats | None = None  # the latest it reported
        self.num_restarts = 0
        self.last_error = ""
        # decode: (own epoch, prefill endpoints) it last acknowledged
        self.pushed_endpoints: tuple[int, list] | None = None
        # new incarnation not yet in the registry exchange: a prefill engine
        # not yet known to the decode engines, a decode engine without the list
        self.unregistered = False
        self.answered = False  # the last health check got an answer
        self.draining = False  # an operator drained it: no new work (migration)
        self.local_pid: int | None = None  # its pid, when visible from this process


class RayBackend(Backend):
    def __init__(
        self,
        handles: list[EngineHandle],
        *,
        tokenizer: Any,
        model_name: str,
        output_addr: str,
        disagg_min_tokens: int = 0,
        health_interval_s: float = 0.5,
        call_timeout_s: float = 5.0,
        cluster_secret: bytes | None = None,
        engine_dead_after_s: float = 30.0,
        reader_restart_delay_s: float = 0.5,
        max_queued_outputs: int = 512,
        routing: RoutingConfig | None = None,
        migration: MigrationPolicy | None = None,
        gateway_session: int = 0,
    ) -> None:
        """``call_timeout_s``: a Ray control call slower than this gives no
        verdict (the engine may be slow); ``engine_dead_after_s``: no heartbeat
        for this long means dead. ``reader_restart_delay_s``: first backoff
        before restarting a failed output reader (doubles, up to 5 s).
        ``max_queued_outputs``: undelivered outputs of one request before its
        stream is cut (a client that does not read). ``routing``: router
        policy and weights (``cluster/routing``; default: kv-aware when a
        pool has more than one engine). ``gateway_session``: this gateway's
        session (``cluster/engines/attach.py``); an engine serving an older one is
        adopted at its first probe."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.max_model_len = 0  # known once engines report ready
        self.output_addr = output_addr
        self.router = Router(disagg_min_tokens)
        slow_after_s = min(4 * health_interval_s, engine_dead_after_s / 2)
        self.engines = {
            h.engine_id: _Engine(
                h,
                self.router.add(h.engine_id, h.role),
                EngineHealth(dead_after_s=engine_dead_after_s, slow_after_s=slow_after_s),
            )
            for h in handles
        }
        self.disaggregated = "prefill" in self.router.pools() or "decode" in self.router.pools()
        pool_sizes: dict[str, int] = {}
        for h in handles:
            pool_sizes[h.role] = pool_sizes.get(h.role, 0) + 1
        self.routing = ClusterRouting(routing or RoutingConfig(), self.router, pool_sizes)
        self.health_interval_s = health_interval_s
        self.call_timeout_s = call_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._auth = PlaneAuth(self._ctx, cluster_secret)
        self.malformed_frames = FrameCounters()
        self._pull: zmq.asyncio.Socket | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._enc = msgspec.msgpack.Encoder()
        self.num_engine_restarts = 0
        self.num_orphans_aborted = 0  # requests aborted on an engine that came back
        self.reader_restart_delay_s = reader_restart_delay_s
        self.reader_task: asyncio.Task | None = None
        self.max_queued_outputs = max_queued_outputs
        self._consumers: dict[str, asyncio.Task] = {}  # request id -> task iterating it
        self.num_streams_cut = 0
        self.num_reader_restarts = 0
        self._reader_up = False
        self.recent_errors: collections.deque[ErrorEvent] = collections.deque(maxlen=50)
        self.migration = migration or MigrationPolicy()
        self.num_migrations: dict[str, int] = {}  # reason -> count (tandem:migrations_total)
        self.gateway_session = gateway_session
        self.num_adopted_aborts = 0  # requests of earlier gateways aborted on adoption
        # fast death verdicts (cluster/engines/death_watch.py)
        self._disconnects = DisconnectWatch(self._on_disconnect)
        self._confirming: set[asyncio.Task] = set()
        self.death_confirm_window_s = 1.0
        self._node_id: str | None = None  # this process's Ray node

    # ---- lifecycle -----------------------------------------------------------

    async def start(self, ready_timeout_s: float = 600.0) -> None:
        """Bind the output socket, wait until every engine is ready, start
        the reader and health tasks. Must run on the gateway's event loop."""
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, GATEWAY_OUTPUT.hard_limit)
        self._auth.server(self._pull, GATEWAY_OUTPUT.socket)
        self._pull.bind(self.output_addr)
        self._node_id = _ray_node_id()
        self._tasks.append(asyncio.create_task(self._supervise_reader()))
        events = self.routing.start(self._ctx, self._auth, self._kv_snapshot, self.malformed_frames)
        if events is not None:
            self._tasks.append(events)
        deadline = asyncio.get_running_loop().time() + ready_timeout_s
        while not all(e.state.ready for e in self.engines.values()):
            await self._check_engines()
            if asyncio.get_running_loop().time() > deadline:
                missing = [e for e, x in self.engines.items() if not x.state.ready]
                raise TimeoutError(f"engines not ready after {ready_timeout_s}s: {missing}")
            await asyncio.sleep(0.2)
        self._tasks.append(asyncio.create_task(self._health_loop()))

    async def close(self) -> None:
        self._disconnects.close()
        for t in [*self._tasks, *self._confirming]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._confirming, return_exceptions=True)
        for e in self.engines.values():
            if e.socket is not None:
                e.socket.close(linger=0)
        if self._pull is not None:
            self._pull.close(linger=0)
        self.routing.close()
        self._auth.close()
        self._ctx.term()

    async def _supervise_reader(self) -> None:
        """Run the output reader; whenever it ends, fail the streams in flight
        and start it again after a backoff (``is_ready`` is False meanwhile)."""
        loop = asyncio.get_running_loop()
        num_quick_failures = 0
        try:
            while True:
                self.reader_task = asyncio.create_task(self._read_outputs())
                self._reader_up = True
                started_s = loop.time()
                await asyncio.wait([self.reader_task])
                self._reader_up = False
                task = self.reader_task
                cause = "cancelled" if task.cancelled() else repr(task.exception())
                if loop.time() - started_s > 30.0:
                    num_quick_failures = 0  # it had been working: back off from the start
                delay_s = min(self.reader_restart_delay_s * 2**num_quick_failures, 5.0)
                num_quick_failures += 1
                logger.error("output reader ended (%s); restarting in %.1f s", cause, delay_s)
                self.num_reader_restarts += 1
                self._error("gateway", f"output reader ended ({cause}); restarted")
                self._fail_all_streams(f"the gateway's output reader failed ({cause})")
                await asyncio.sleep(delay_s)
        finally:
            if self.reader_task is not None:
                self.reader_task.cancel()

    def _cut(self, request_id: str) -> None:
        """The consumer of ``request_id`` is not keeping up: abort the request on
        its engines, drop its queue, cancel its consumer (as a disconnect)."""
        self.num_streams_cut += 1
        logger.warning(
            "request %s: %d outputs undelivered (client not reading); stream cut",
            request_id,
            self.max_queued_outputs,
        )
        for e in self.engines.values():
            if request_id in e.requests:
                self._send_abort(e, [request_id])
                e.requests.discard(request_id)
        self._streams.pop(request_id, None)
        consumer = self._consumers.pop(request_id, None)
        if consumer is not None:
            consumer.cancel()

    def _fail_all_streams(self, reason: str) -> None:
        """Every request in flight ends with an error and is aborted on its engines."""
        for e in self.engines.values():
            if e.requests:
                self._send_abort(e, list(e.requests))
            self._fail_inflight(e, reason)

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
                q = self._streams.get(out.request_id)
                if q is not None:
                    if q.qsize() >= self.max_queued_outputs:
                        self._cut(out.request_id)
                    else:
                        q.put_nowait((batch.engine_id, out))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self._check_engines()
            except Exception:  # noqa: BLE001 - keep probing
                logger.exception("engine health check failed")

    async def _check_engines(self) -> None:
        await asyncio.gather(*(self._check_engine(e) for e in self.engines.values()))
        await self._register_prefill_engines()

    async def _register_prefill_engines(self) -> None:
        """Tell decode engines which prefill engines they may read from. A
        new decode incarnation gets requests once it holds the list, a new
        prefill one once every answering decode engine holds it."""
        engines = list(self.engines.values())

        async def call(e: _Engine, endpoints: list) -> Any:
            return await _await_ref(e.handle.actor.set_prefill_endpoints.remote(endpoints))

        decode = [e for e in engines if e.state.role == "decode" and e.answered]
        all_ok = await push_prefill_endpoints(decode, engines, call, self.call_timeout_s)
        for e in engines:
            if not e.unregistered or not e.answered:
                continue
            if (
                e.state.role == "decode"
                and e.pushed_endpoints is not None
                and e.pushed_endpoints[0] == e.state.epoch
            ) or (e.state.role == "prefill" and all_ok):
                e.unregistered = False
                e.state.ready = not e.draining

    async def _check_engine(self, e: _Engine) -> None:
        """One health probe. A Ray timeout is no verdict (slow is not dead);
        death is Ray saying so or ``engine_dead_after_s`` without a heartbeat."""
        eid = e.state.engine_id
        info = None
        cause = "no heartbeat"
        try:
            info = await self._call(e, "ready")
            if info.get("gateway_session", self.gateway_session) != self.gateway_session:
                info = await self._adopt(e, info)
                if info is None:
                    return  # a newer gateway serves it
        except TimeoutError:
            pass  # paused, starved or busy: the heartbeat decides
        except Exception as exc:  # noqa: BLE001 - the actor died or is restarting
            if getattr(exc, "actor_init_failed", False) and not e.state.epoch:
                # never came up: a config or model error, not a crash to wait out
                raise RuntimeError(f"engine {eid} failed to start: {exc}") from exc
            e.health.mark_actor_dead()
            cause = type(exc).__name__
        e.answered = info is not None
        if info is not None and info["epoch"] != e.state.epoch:
            self._connect(e, info)
        if not e.state.epoch:
            return  # not up yet
        liveness = e.health.liveness()
        if liveness is Liveness.DEAD:
            self._declare_dead(e, cause)
            return
        if e.health.orphans:  # the same incarnation is back: nothing may run for nobody
            self.num_orphans_aborted += len(e.health.orphans)
            logger.warning("engine %s is back; aborting %d orphans", eid, len(e.health.orphans))
            orphans, e.health.orphans = sorted(e.health.orphans), set()
            self._send_abort(e, orphans)
        if liveness is Liveness.ALIVE:
            # stats() runs on the loop thread: ask only while it heartbeats
            try:
                self._update_stats(e, await self._call(e, "stats"))
            except Exception as exc:  # noqa: BLE001 - stale stats are not a verdict
                logger.debug("engine %s stats: %r", eid, exc)
        e.state.ready = not e.unregistered and not e.draining  # see _register_prefill_engines

    async def _adopt(self, e: _Engine, info: dict[str, Any]) -> dict[str, Any] | None:
        """``e`` answers to another gateway session (``cluster/engines/attach.py``).
        An older one (this gateway adopts engines left running, or Ray
        restarted a detached engine with its first gateway's arguments):
        attach it here; it aborts the old session's requests. A newer one:
        another gateway took it over; this one stops using it (its streams
        end with an error) and returns None."""
        eid = e.state.engine_id
        if info["gateway_session"] < self.gateway_session:
            ref = e.handle.actor.attach.remote(self.output_addr, self.gateway_session)
            try:
                info = await asyncio.wait_for(_await_ref(ref), self.call_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"attach took over {self.call_timeout_s} s") from None
            if info["num_aborted"]:
                self.num_adopted_aborts += info["num_aborted"]
                logger.warning(
                    "adopted %s: aborted %d requests of an earlier gateway",
                    eid,
                    info["num_aborted"],
                )
            if info["gateway_session"] == self.gateway_session:
                return info
        if e.state.ready or e.requests:
            logger.error("engine %s is served by a newer gateway; not using it", eid)
            self._error(eid, "taken over by a newer gateway", e)
            e.state.ready = False
            self._fail_inflight(e, f"engine {eid} was taken over by another gateway")
        e.answered = False
        return None

    def _declare_dead(self, e: _Engine, cause: str) -> None:
        """The verdict: ``e``'s requests fail (decode streams migrate) and stay
        its orphans. Once per incarnation (``ready`` is False after it)."""
        if not e.state.ready:
            return
        eid = e.state.engine_id
        logger.warning("engine %s is dead (%s)", eid, cause)
        self._error(eid, f"dead ({cause})", e)
        e.state.ready = False
        e.health.orphans.update(e.requests)
        self._fail_inflight(e, f"engine {eid} failed: {cause}", REASON_DEAD)

    def _on_disconnect(self, engine_id: str, epoch: int) -> None:
        """The input connection to this incarnation dropped: confirm (task)."""
        e = self.engines[engine_id]
        if e.state.epoch != epoch or e.health.actor_dead:
            return
        task = asyncio.create_task(self._confirm_death(e, epoch))
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)

    async def _confirm_death(self, e: _Engine, epoch: int) -> None:
        """Dead on positive evidence only: its process gone (same node), else
        Ray's answer to a probe now rather than at the next health check."""
        pid = e.local_pid
        if pid is not None and await confirm_exit(pid, self.death_confirm_window_s):
            if e.state.epoch == epoch:
                e.health.mark_actor_dead()
                self._declare_dead(e, f"process {pid} exited")
            return
        try:
            await self._check_engine(e)
        except Exception:  # noqa: BLE001 - the health loop probes again
            logger.exception("engine %s: probe after disconnect failed", e.state.engine_id)

    async def _kv_snapshot(self, engine_id: str) -> Any:
        return await self._call(self.engines[engine_id], "kv_events_snapshot")

    async def _call(self, e: _Engine, method: str) -> Any:
        ref = getattr(e.handle.actor, method).remote()
        try:
            return await asyncio.wait_for(_await_ref(ref), self.call_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{method} took over {self.call_timeout_s} s") from None

    def _connect(self, e: _Engine, info: dict[str, Any]) -> None:
        """A (new) incarnation answered ready(): connect its input socket."""
        if e.state.epoch:
            self.num_engine_restarts += 1
            e.num_restarts += 1
            self._error(e.state.engine_id, f"restarted (epoch {info['epoch']})", e)
            logger.warning("engine %s restarted (epoch %s)", e.state.engine_id, info["epoch"])
            self._fail_inflight(e, f"engine {e.state.engine_id} restarted", REASON_RESTARTED)
        if e.socket is not None:
            e.socket.close(linger=0)
        e.socket = self._ctx.socket(zmq.PUSH)
        e.socket.setsockopt(zmq.LINGER, 0)
        self._auth.client(e.socket)
        self._disconnects.watch(e.state.engine_id, info["epoch"], e.socket)
        e.socket.connect(info["input_addr"])
        # its pid says "exited" only if this process can see it while it answers
        pid = info.get("pid")
        same_node = self._node_id is not None and info.get("node_id") == self._node_id
        e.local_pid = pid if same_node and pid and not process_gone(pid) else None
        e.state.epoch = info["epoch"]
        e.unregistered = e.state.role in ("prefill", "decode")
        e.state.max_num_seqs = info["max_num_seqs"]
        e.state.info = info
        e.health.reset(info["epoch"])
        self.routing.on_connected(e.state.engine_id, e.state.role, info)
        lens = [x.state.info.get("max_model_len", 0) for x in self.engines.values()]
        self.max_model_len = min(v for v in lens if v) if any(lens) else 0

    def _update_stats(self, e: _Engine, payload: bytes) -> None:
        """``payload``: the actor's msgpack ``EngineStats``, validated like a
        frame (a bad one is counted under socket ``engine_stats`` and dropped)."""
        try:
            if not isinstance(payload, bytes):
                raise MalformedFrame(f"stats of type {type(payload).__name__}, not bytes")
            stats: EngineStats = decode(STATS_DECODER, payload)
        except MalformedFrame as exc:
            self.malformed_frames.record("engine_stats", e.state.engine_id, exc)
            return
        e.stats = stats
        q = stats.scheduler
        e.state.kv_cache_usage = q.kv_cache_usage
        e.state.num_running = q.num_running_reqs
        e.state.num_waiting = q.num_waiting_reqs + q.num_waiting_for_remote_kvs

    def _error(self, source: str, message: str, e: _Engine | None = None) -> None:
        """Remember a failure for operators (``/cluster/state``)."""
        self.recent_errors.append(ErrorEvent(time.time(), source, message))
        if e is not None:
            e.last_error = message

    def _fail_inflight(self, e: _Engine, reason: str, lost: str | None = None) -> None:
        """End every request in flight on ``e``. ``lost`` (a migration reason):
        the engine's work is gone, so a decode stream may migrate; None: a
        plain error (e.g. the gateway's own reader failed)."""
        for rid in list(e.requests):
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait((e.state.engine_id, _ENGINE_FAILED, reason, lost, e.state.epoch))
        e.requests.clear()

    # ---- Backend API ------------------------------------------------------------

    def is_ready(self) -> tuple[bool, str]:
        if not self._reader_up:
            return False, "the output reader is down (restarting)"
        for role in sorted(self.router.pools()):
            if not self.router.ready_engines(role):
                return False, f"no ready {role} engine"
        return True, ""

    def degraded(self) -> str:
        down = sorted(eid for eid, e in self.engines.items() if not e.state.ready)
        return f"not serving: {', '.join(down)}" if down else ""

    async def abort(self, request_id: str) -> None:
        for e in self.engines.values():
            if request_id in e.requests:
                self._send_abort(e, [request_id])
                e.requests.discard(request_id)

    def route_log_fields(self, request_id: str) -> dict[str, Any]:
        return self.routing.log_fields(request_id)

    async def abort_choice(self, request_id: str, index: int) -> None:
        child_id = child_request_id(request_id, index)  # only the engine that forked knows it
        for e in self.engines.values():
            if request_id in e.requests:
                self._send_abort(e, [child_id])

    def _send_abort(self, e: _Engine, request_ids: list[str]) -> None:
        """Never raises: an abort that cannot be queued now (engine not
        connected, its queue full) is kept as an orphan and sent once the
        engine is alive again."""
        try:
            self._send(e, b"A", EngineAbort(request_ids))
        except (BackendUnavailable, zmq.ZMQError):
            # e.g. its input queue is full (engine stalled behind its outputs);
            # retried at each health check, and its stall timeout ends them too
            logger.warning(
                "abort of %d requests not delivered to %s", len(request_ids), e.state.engine_id
            )
            e.health.orphans.update(request_ids)

    def _send(self, e: _Engine, kind: bytes, msg: Any) -> None:
        if e.socket is None:
            raise BackendUnavailable(f"engine {e.state.engine_id} is not connected")
        e.socket.send_multipart([kind, self._enc.encode(msg)], flags=zmq.NOBLOCK)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        rid = request.request_id
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        consumer = asyncio.current_task()
        if consumer is not None:
            self._consumers[rid] = consumer
        ledger = StreamLedger(request)
        finished = False
        hashes = self.routing.hashes(request)
        try:
            attempt = request
            while True:
                try:
                    async for out in self._attempt(attempt, q, ledger, hashes):
                        ledger.record(out)
                        yield out
                    finished = True  # the stream ended by itself: every choice finished
                    return
                except EngineLost as lost:
                    error = await self._prepare_migration(lost, q, ledger)
                    if error is not None:
                        finished = True
                        yield _error(rid, error)
                        return
                    attempt = ledger.resubmission()
                    hashes = self.routing.hashes(attempt)
        finally:
            if not finished:
                await self.abort(rid)
            self._streams.pop(rid, None)
            self._consumers.pop(rid, None)
            for e in self.engines.values():
                e.requests.discard(rid)

    async def _attempt(
        self, request: EngineRequest, q: asyncio.Queue, ledger: StreamLedger, hashes: PromptHashes
    ) -> AsyncIterator[EngineOutput]:
        """One try at ``request``: (P then) D, or a colocated engine. Raises
        ``EngineLost`` out of the generating engine's stream (migration)."""
        migrated = ledger.num_migrations > 0
        exclude = self._lost_engines(ledger)
        if not self.disaggregated:
            choice = self._pick("colocated", hashes, streaming=migrated, exclude=exclude)
            if choice is None:
                yield _error(request.request_id, "no ready colocated engine")
                return
            async for out in self._stream(choice, request, q, True, request.n):
                yield out
            return
        first = None
        # n > 1: P prefills all but the last prompt token and samples nothing;
        # D forks the children and each samples its own first token
        # (scheduler/fork.py), so a one-token prompt has nothing for P
        n = request.n
        num_prompt = len(request.prompt_token_ids)
        split = request.sampling_params.max_tokens > 1 if n == 1 else num_prompt > 1
        decode_choice = None
        if migrated:  # D by prefix and load, P only for what D lacks (cluster/disagg/migration.py)
            handoff_min = self.migration.handoff_min_tokens
            plan = self.routing.plan_migration(hashes, split, handoff_min, exclude)
            if plan is None:
                yield _error(request.request_id, "no ready decode engine")
                return
            remote, decode_choice = plan.remote_prefill, plan.decode
        else:
            plan = self.routing.plan(hashes, split)
            if plan is None:
                raise BackendUnavailable("no ready decode engine")
            remote, decode_choice = plan.remote_prefill, plan.decode
        if remote:
            first = await self._remote_prefill(request, q, hashes)
        if first is not None:
            if first.finished:  # EOS as the first token: nothing to hand off
                yield first
                return
            if first.new_token_ids:
                yield first
            request = decode_request(request, first)
        choice = decode_choice
        if choice is None or not choice.engine.ready:  # it went away while P ran
            choice = self._pick(
                "decode", hashes, streaming=first is not None or migrated, exclude=exclude
            )
        if choice is None:
            yield _error(request.request_id, "no ready decode engine")
            return
        async for out in self._stream(choice, request, q, first is None, n):
            yield out

    def _lost_engines(self, ledger: StreamLedger) -> set[str]:
        """Engines whose current incarnation this request lost: never again
        (a late output of the old run could not be told from the new one's)."""
        return {eid for eid, epoch in ledger.lost if self.engines[eid].state.epoch == epoch}

    async def _prepare_migration(
        self, lost: EngineLost, q: asyncio.Queue, ledger: StreamLedger
    ) -> str | None:
        """Decide whether the stream moves on; wait (bounded) for an engine to
        take it. Returns None to resubmit, else the error text to end with."""
        ledger.lost.add((lost.engine_id, lost.epoch))
        if not self.migration.enabled:
            return lost.message
        if ledger.request.n > 1:  # the ledger follows one choice's tokens, not n
            return f"{lost.message} (requests with n > 1 do not migrate)"
        if not ledger.can_migrate(self.migration):
            return f"{lost.message} (migrated {ledger.num_migrations} times already)"
        while not q.empty():  # anything still queued came from the lost engine
            q.get_nowait()
        role = "decode" if self.disaggregated else "colocated"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.migration.wait_for_engine_s
        while True:
            exclude = self._lost_engines(ledger)
            if any(st.engine_id not in exclude for st in self.router.ready_engines(role)):
                break
            if loop.time() >= deadline:
                return (
                    f"{lost.message}; no {role} engine to continue on within "
                    f"{self.migration.wait_for_engine_s:g} s"
                )
            await asyncio.sleep(0.05)
        ledger.num_migrations += 1
        self.num_migrations[lost.reason] = self.num_migrations.get(lost.reason, 0) + 1
        logger.info(
            "request %s: %s on %s; migrating after %d tokens",
            ledger.request.request_id,
            lost.reason,
            lost.engine_id,
            len(ledger.sent_token_ids),
        )
        return None

    def _pick(
        self,
        role: str,
        hashes: PromptHashes,
        streaming: bool = False,
        exclude: set[str] = frozenset(),
    ) -> Choice | None:
        choice = self.routing.choose(role, hashes, exclude=exclude)
        if choice is None:
            if streaming:
                return None
            raise BackendUnavailable(f"no ready {role} engine")
        return choice

    # ---- drain --------------------------------------------------------------------

    async def drain(self, engine_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stop new work on ``engine_id``, migrate its streams away (decode /
        colocated; a prefill engine's short requests finish), wait until it
        holds none. ValueError for an unknown id."""
        e = self.engines.get(engine_id)
        if e is None:
            raise ValueError(f"engine_id: no engine {engine_id!r} (have {sorted(self.engines)})")
        e.draining = True
        e.state.ready = False
        moved = 0
        if e.state.role != "prefill" and e.requests:
            moved = len(e.requests)
            self._send_abort(e, sorted(e.requests))
            self._fail_inflight(e, f"engine {engine_id} drained", REASON_DRAIN)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        idle = False
        while loop.time() < deadline:
            try:
                stats = STATS_DECODER.decode(await self._call(e, "stats")).scheduler
            except Exception:  # noqa: BLE001 - slow or dead: holds nothing of ours soon
                stats = None
            if (
                not e.requests
                and stats is not None
                and not any(getattr(stats, k) for k in _BUSY_STATS)
            ):
                idle = True
                break
            await asyncio.sleep(0.1)
        return {"engine_id": engine_id, "draining": True, "migrated": moved, "idle": idle}

    def undrain(self, engine_id: str) -> dict[str, Any]:
        """Let a drained engine take new work again (once healthy)."""
        e = self.engines.get(engine_id)
        if e is None:
            raise ValueError(f"engine_id: no engine {engine_id!r} (have {sorted(self.engines)})")
        e.draining = False
        return {"engine_id": engine_id, "draining": False}

    async def _remote_prefill(
        self, request: EngineRequest, q: asyncio.Queue, hashes: PromptHashes
    ) -> EngineOutput | None:
        """Run the prompt on a prefill engine; retry once on another. Returns
        P's output (first token + kv_transfer_params), or None to prefill on
        the decode engine instead."""
        p_req = prefill_request(request)
        tried: set[str] = set()
        for _ in range(2):
            choice = self.routing.choose("prefill", hashes, exclude=tried)
            if choice is None:
                return None
            st = choice.engine
            tried.add(st.engine_id)
            out = None
            async for o in self._stream(choice, p_req, q, observe=True):
                out = o
            if out is None or out.finish_reason == FinishReason.ERROR:
                logger.warning("prefill on %s failed: %s", st.engine_id, out and out.error)
                continue
            if request.n > 1 and not out.kv_transfer_params:
                return None  # nothing handed off: D prefills and forks by itself
            if out.finish_reason == FinishReason.LENGTH and out.kv_transfer_params:
                return EngineOutput(
                    request_id=out.request_id,
                    new_token_ids=out.new_token_ids,
                    new_logprobs=out.new_logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                    num_cached_tokens=out.num_cached_tokens,
                    kv_transfer_params=out.kv_transfer_params,
                    timings=out.timings,
                )
            return out  # finished on P (EOS / stop token): final as is
        return None

    async def _stream(
        self,
        choice: Choice,
        request: EngineRequest,
        q: asyncio.Queue,
        observe: bool = False,
        num_choices: int = 1,
    ) -> AsyncIterator[EngineOutput]:
        """``request`` on one engine until ``num_choices`` choices finished
        (each finishes once) or an error ended it. ``observe``: this engine
        computes the prompt; its reported prefix hit is compared with the
        router's prediction, and until then the prompt's predicted uncached
        tokens count in the engine's ``queued_prefill_tokens``."""
        e = self.engines[choice.engine.engine_id]
        eid = e.state.engine_id
        e.requests.add(request.request_id)
        e.state.num_inflight += 1
        queued = len(request.prompt_token_ids) - choice.predicted_hit_tokens if observe else 0
        e.state.queued_prefill_tokens += queued
        try:
            try:
                self._send(e, b"R", request)
            except zmq.Again:  # the engine stopped reading: its output queue is full
                yield _error(request.request_id, f"engine {eid} is not accepting requests")
                return
            while True:
                item = await q.get()
                if item[0] != eid:
                    continue  # late output of an engine this request left
                if item[1] is _ENGINE_FAILED:
                    _, _, message, lost, epoch = item
                    if lost is not None and e.state.role != "prefill":
                        raise EngineLost(lost, eid, epoch, message)
                    yield _error(request.request_id, message)
                    return
                out: EngineOutput = item[1]
                if observe and out.finish_reason != FinishReason.ERROR:
                    observe = False
                    e.state.queued_prefill_tokens -= queued
                    queued = 0
                    self.routing.observe_hit(request.request_id, choice, out.num_cached_tokens)
                yield out
                if out.finished:
                    num_choices -= 1
                    if num_choices <= 0 or out.finish_reason is FinishReason.ERROR:
                        return
        finally:
            e.state.num_inflight -= 1
            e.state.queued_prefill_tokens -= queued

    def metrics_snapshot(self) -> BackendMetrics:
        engines = []
        for eid, e in self.engines.items():
            stats = e.stats or EngineStats(eid, e.state.role, e.state.epoch)
            state = e.health.liveness().value if e.state.epoch else "starting"
            engines.append(
                EngineMetrics(
                    stats,
                    epoch=e.state.epoch,
                    state=state,
                    ready=e.state.ready,
                    num_restarts=e.num_restarts,
                    last_error=e.last_error,
                )
            )
        return BackendMetrics(
            engines=engines,
            num_disagg_decisions=dict(self.router.num_decisions),
            router_decisions=self.routing.decisions(),
            prefix_hit_error=self.routing.hit_error.snapshot(),
            num_migrations=dict(self.num_migrations),
            malformed_frames=self.malformed_frames.snapshot(),
            auth_failures=self._auth.failures(),
            num_streams_cut=self.num_streams_cut,
            num_orphans_aborted=self.num_orphans_aborted,
            num_reader_restarts=self.num_reader_restarts,
            num_engine_restarts=self.num_engine_restarts,
            recent_errors=list(self.recent_errors),
        )

    # ---- test hooks -------------------------------------------------------------

    async def call_all(self, method: str) -> dict[str, Any]:
        """Call a control method (``check_integrity``, ``stats``) on every
        engine; ``stats`` answers are decoded into ``EngineStats``."""
        out = {}
        for eid, e in self.engines.items():
            ref = getattr(e.handle.actor, method).remote()
            out[eid] = await asyncio.wait_for(_await_ref(ref), self.call_timeout_s)
            if method == "stats":
                out[eid] = STATS_DECODER.decode(out[eid])
        return out


def _error(request_id: str, message: str) -> EngineOutput:
    return EngineOutput(request_id=request_id, finish_reason=FinishReason.ERROR, error=message)


async def _await_ref(ref):
    return await ref


def _ray_node_id() -> str | None:
    """This process's Ray node id (None outside Ray): engines that share it
    share this process's /proc."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no Ray context: no pid evidence
        return None
