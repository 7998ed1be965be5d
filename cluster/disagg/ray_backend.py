"""The production backend: Ray engine pools behind a ZMQ data plane.

    RayBackend (the gateway's Backend)
      data_plane.py     sockets to and from the engines, one queue per stream
      membership.py     probes, (re)connects, prefill registry, dead verdicts
      orchestration.py  each request: plan -> prefill -> handoff -> decode
      migration.py      streams that lost their engine go on elsewhere
      drain.py          an operator takes an engine out of service
      scaling.py        pools that grow and shrink while serving
    engine.py: the record of one engine all of them share.

Every part runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tandem.cluster.disagg import drain
from tandem.cluster.disagg.data_plane import DataPlane
from tandem.cluster.disagg.engine import Engine, ErrorLog
from tandem.cluster.disagg.membership import Membership, ray_node_id
from tandem.cluster.disagg.migration import MigrationPolicy, Migrator
from tandem.cluster.disagg.orchestration import Orchestrator
from tandem.cluster.disagg.scaling import PoolScaler
from tandem.cluster.engines.health import EngineHealth
from tandem.cluster.engines.pools import EngineHandle
from tandem.cluster.gateway.backend import Backend, BackendMetrics, EngineMetrics, PoolMoves
from tandem.cluster.routing.cluster_routing import ClusterRouting
from tandem.cluster.routing.policy import RoutingConfig
from tandem.cluster.routing.router import Router
from tandem.scheduler.engine_stats import STATS_DECODER, EngineStats
from tandem.scheduler.fork import child_request_id
from tandem.wire.engine_protocol import EngineOutput, EngineRequest


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
        pool_sizes: dict[str, int] | None = None,
    ) -> None:
        """``call_timeout_s``: a Ray control call slower than this gives no
        verdict (the engine may be slow); ``engine_dead_after_s``: no heartbeat
        for this long means dead. ``reader_restart_delay_s``: first backoff
        before restarting a failed output reader (doubles, up to 5 s).
        ``max_queued_outputs``: undelivered outputs of one request before its
        stream is cut (a client that does not read). ``routing``: router
        policy and weights (``cluster/routing``; default: kv-aware when a
        pool has more than one engine). ``gateway_session``: this gateway's
        session (``cluster/engines/attach.py``): the return address of its
        requests; an engine that does not serve it yet is joined at its
        first probe. ``pool_sizes``: what the default router is chosen by
        (the most engines each pool may reach; default: the handles')."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.router = Router(disagg_min_tokens)
        self._health = (engine_dead_after_s, min(4 * health_interval_s, engine_dead_after_s / 2))
        self.engines: dict[str, Engine] = {}
        for h in handles:
            self.add_engine(h)
        pools = self.router.pools()
        disaggregated = "prefill" in pools or "decode" in pools
        if pool_sizes is None:
            pool_sizes = {}
            for h in handles:
                pool_sizes[h.role] = pool_sizes.get(h.role, 0) + 1
        self.routing = ClusterRouting(routing or RoutingConfig(), self.router, pool_sizes)
        self.errors = ErrorLog()
        self.plane = DataPlane(
            self.engines,
            self.errors,
            output_addr=output_addr,
            cluster_secret=cluster_secret,
            max_queued_outputs=max_queued_outputs,
            reader_restart_delay_s=reader_restart_delay_s,
            on_disconnect=lambda eid, epoch: self.members.on_disconnect(eid, epoch),
            gateway_session=gateway_session,
        )
        self.members = Membership(
            self.engines,
            self.plane,
            self.routing,
            self.errors,
            self.plane.malformed_frames,
            health_interval_s=health_interval_s,
            call_timeout_s=call_timeout_s,
            gateway_session=gateway_session,
        )
        role = "decode" if disaggregated else "colocated"
        self.migrator = Migrator(migration or MigrationPolicy(), self.engines, self.router, role)
        self.orchestrator = Orchestrator(
            self.engines, self.plane, self.routing, self.migrator, disaggregated
        )
        self._tasks: list[asyncio.Task] = []
        self.scaler: PoolScaler | None = None  # set by the service that owns the pools

    def add_engine(self, handle: EngineHandle) -> Engine:
        """An engine of a pool, known from now on: it takes requests once the
        health probe connected it and the prefill registry holds it."""
        dead_after_s, slow_after_s = self._health
        health = EngineHealth(dead_after_s=dead_after_s, slow_after_s=slow_after_s)
        e = Engine(handle, self.router.add(handle.engine_id, handle.role), health)
        self.engines[handle.engine_id] = e
        return e

    def remove_engine(self, engine_id: str) -> Engine:
        """Forget an engine that left its pool (scaling.py: drained first): the
        router, the prefix index, its KV events, its input socket; the next
        registry push drops a prefill engine from the decode engines' lists."""
        e = self.engines.pop(engine_id)
        e.removed = True
        e.state.ready = False
        self.router.remove(engine_id)
        self.routing.on_removed(engine_id)
        self.plane.disconnect(e)
        return e

    @property
    def max_model_len(self) -> int:  # known once engines report ready
        return self.members.max_model_len

    # ---- lifecycle -----------------------------------------------------------

    async def start(self, ready_timeout_s: float = 600.0) -> None:
        """Bind the output socket, wait until every engine is ready, start
        the reader and health tasks. Must run on the gateway's event loop."""
        self._tasks.append(self.plane.start())
        self.members.node_id = ray_node_id()
        events = self.routing.start(
            self.plane.ctx, self.plane.auth, self._kv_snapshot, self.plane.malformed_frames
        )
        if events is not None:
            self._tasks.append(events)
        await self.members.wait_ready(ready_timeout_s)
        self._tasks.append(asyncio.create_task(self.members.health_loop()))

    async def close(self) -> None:
        self.plane.stop_watching()
        tasks = [*self._tasks, *self.members.confirming]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.scaler is not None:
            await self.scaler.close()
        await self.members.leave_all()  # engines that serve on drop this gateway's requests
        self.plane.close_sockets()
        self.routing.close()
        self.plane.terminate()

    async def _kv_snapshot(self, engine_id: str) -> Any:
        return await self.members.call(self.engines[engine_id], "kv_events_snapshot")

    # ---- Backend API ------------------------------------------------------------

    def is_ready(self) -> tuple[bool, str]:
        if not self.plane.reader_up:
            return False, "the output reader is down (restarting)"
        for role in sorted(self.router.pools()):
            if not self.router.ready_engines(role):
                return False, f"no ready {role} engine"
        return True, ""

    def degraded(self) -> str:
        down = sorted(eid for eid, e in self.engines.items() if not e.state.ready)
        return f"not serving: {', '.join(down)}" if down else ""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        return self.orchestrator.generate(request)

    def num_ready(self, request_id: str) -> int:
        q = self.plane.streams.get(request_id)
        return q.qsize() if q is not None else 0

    async def abort(self, request_id: str) -> None:
        self.plane.abort(request_id)

    async def abort_choice(self, request_id: str, index: int) -> None:
        child_id = child_request_id(request_id, index)  # only the engine that forked knows it
        for e in self.engines.values():
            if request_id in e.requests:
                self.plane.send_abort(e, [child_id])

    def route_log_fields(self, request_id: str) -> dict[str, Any]:
        return self.routing.log_fields(request_id)

    async def drain(self, engine_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        return await drain.drain(self.members, self.plane, engine_id, timeout_s)

    def undrain(self, engine_id: str) -> dict[str, Any]:
        return drain.undrain(self.engines, engine_id)

    async def scale_pool(self, role: str, engines: int) -> dict[str, Any]:
        if self.scaler is None:
            raise ValueError("pool: this gateway does not own its engine pools")
        return await self.scaler.scale(role, engines)

    async def move_engine(
        self, source_pool: str, dest_pool: str, engine_id: str | None = None
    ) -> dict[str, Any]:
        if self.scaler is None:
            raise ValueError("pool: this gateway does not own its engine pools")
        return await self.scaler.move_engine(source_pool, dest_pool, engine_id=engine_id)

    async def reset_prefix_cache(self) -> dict[str, bool]:
        return await self._call_every("reset_prefix_cache")

    async def profile(self, start: bool) -> dict[str, Any]:
        answers = await self._call_every("start_profile" if start else "stop_profile", 120.0)
        return answers

    async def _call_every(self, method: str, timeout_s: float | None = None) -> dict[str, Any]:
        """``method`` on every engine that runs, at once; an engine's
        ValueError is raised (naming it), any other failure answers False."""
        engines = [e for e in self.engines.values() if e.state.epoch and not e.health.actor_dead]

        async def one(e: Engine) -> Any:
            ref = getattr(e.handle.actor, method).remote()
            return await asyncio.wait_for(_await_ref(ref), timeout_s or self.members.call_timeout_s)

        answers = await asyncio.gather(*(one(e) for e in engines), return_exceptions=True)
        out: dict[str, Any] = {}
        for e, answer in zip(engines, answers, strict=True):
            if isinstance(answer, BaseException):
                cause = getattr(answer, "cause", answer)
                if isinstance(cause, ValueError):
                    raise ValueError(str(cause)) from None
                answer = False
            out[e.state.engine_id] = answer
        return out

    def metrics_snapshot(self) -> BackendMetrics:
        # first: it expires the peers' records that are due, so the engines' peer counts match
        peer_load = self.routing.peer_load.stats() if self.routing.peer_load else None
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
                    num_inflight=e.state.num_inflight,
                    queued_prefill_tokens=e.state.queued_prefill_tokens,
                    peer_inflight=e.state.peer_inflight,
                    peer_queued_prefill_tokens=e.state.peer_queued_prefill_tokens,
                )
            )
        return BackendMetrics(
            engines=engines,
            num_disagg_decisions=dict(self.router.num_decisions),
            router_decisions=self.routing.decisions(),
            prefix_hit_error=self.routing.hit_error.snapshot(),
            num_migrations=dict(self.migrator.num_migrations),
            malformed_frames=self.plane.malformed_frames.snapshot(),
            auth_failures=self.plane.auth.failures(),
            num_streams_cut=self.plane.num_streams_cut,
            num_orphans_aborted=self.members.num_orphans_aborted,
            num_reader_restarts=self.plane.num_reader_restarts,
            num_engine_restarts=self.members.num_engine_restarts,
            recent_errors=list(self.errors.events),
            pool_sizes=self.pool_sizes(),
            scaling_actions=self.scaler.log.counts() if self.scaler else {},
            scaling_events=list(self.scaler.log.events) if self.scaler else [],
            planner=self.scaler.log.planner if self.scaler else None,
            pool_moves=self._pool_moves(),
            peer_load=peer_load,
        )

    def _pool_moves(self) -> PoolMoves:
        if self.scaler is None:
            return PoolMoves(False, "this gateway does not own its engine pools (--attach)")
        why = self.scaler.moves_off
        return PoolMoves(why is None, why or "")

    def pool_sizes(self) -> dict[str, int]:
        """Engines per running pool (those still starting are not counted)."""
        sizes = dict.fromkeys(self.scaler.specs if self.scaler else (), 0)
        for e in self.engines.values():
            sizes[e.state.role] = sizes.get(e.state.role, 0) + 1
        return sizes

    # ---- test hooks -------------------------------------------------------------

    async def call_all(self, method: str) -> dict[str, Any]:
        """Call a control method (``check_integrity``, ``stats``) on every
        engine; ``stats`` answers are decoded into ``EngineStats``."""
        out = {}
        for eid, e in list(self.engines.items()):  # a pool may resize meanwhile
            ref = getattr(e.handle.actor, method).remote()
            out[eid] = await asyncio.wait_for(_await_ref(ref), self.members.call_timeout_s)
            if method == "stats":
                out[eid] = STATS_DECODER.decode(out[eid])
        return out


async def _await_ref(ref):
    return await ref
