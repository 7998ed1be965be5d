"""Which engines the backend may use: probing, (re)connecting, registering
prefill engines with decode engines, and the verdicts on dead ones.

Health (``cluster/engines/health.py``): engines send heartbeats from their
loop threads on the output socket; a health task also calls ``ready`` over
Ray. A slow engine (no recent heartbeat, Ray calls timing out) keeps its
requests. A dead one (its process exited: ``cluster/engines/death_watch.py``
confirms a dropped input connection within milliseconds; Ray says the
actor died; or no heartbeat for ``engine_dead_after_s``) fails its in-flight
requests (prefill: retried once on another prefill engine, else prefilled on
the decode engine; decode: migrated, or an error output); they stay its
orphans, aborted on it if the same incarnation comes back. A restarted one
(new epoch) is reconnected and marked ready.

    probe (every health_interval_s):  ready() over Ray
      new epoch        -> connect its input socket (DataPlane), streams of the old one migrate
      not serving us   -> join it (cluster/engines/attach.py); the other gateways stay
      DEAD             -> fail its requests, keep them as orphans
      ALIVE            -> abort orphans, refresh stats (the router's load)
    then: push the prefill registry (cluster/engines/prefill_endpoints.py);
    an engine is ready once registered, not draining

This lives beside the data plane rather than in ``cluster/engines``: its
verdicts drive the router's state and the data plane's sockets and streams.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tandem.cluster.disagg.data_plane import DataPlane
from tandem.cluster.disagg.engine import Engine, ErrorLog
from tandem.cluster.disagg.migration import REASON_DEAD, REASON_RESTARTED
from tandem.cluster.engines.death_watch import confirm_exit, process_gone
from tandem.cluster.engines.health import Liveness
from tandem.cluster.engines.prefill_endpoints import push_prefill_endpoints
from tandem.cluster.routing.cluster_routing import ClusterRouting
from tandem.scheduler.engine_stats import STATS_DECODER, EngineStats
from tandem.wire.frames import FrameCounters, MalformedFrame, decode

logger = logging.getLogger(__name__)


class Membership:
    def __init__(
        self,
        engines: dict[str, Engine],
        plane: DataPlane,
        routing: ClusterRouting,
        errors: ErrorLog,
        malformed_frames: FrameCounters,
        *,
        health_interval_s: float,
        call_timeout_s: float,
        gateway_session: int,
    ) -> None:
        self.engines = engines
        self.plane = plane
        self.routing = routing
        self.errors = errors
        self.malformed_frames = malformed_frames
        self.health_interval_s = health_interval_s
        self.call_timeout_s = call_timeout_s
        self.gateway_session = gateway_session
        self.max_model_len = 0  # known once engines report ready
        self.num_engine_restarts = 0
        self.num_orphans_aborted = 0  # requests aborted on an engine that came back
        self.num_joins = 0  # engines this gateway joined (started by another)
        self.num_join_timeouts = 0  # joins that did not answer within call_timeout_s
        self.death_confirm_window_s = 1.0
        self.confirming: set[asyncio.Task] = set()  # fast death verdicts in progress
        self.node_id: str | None = None  # this process's Ray node

    async def wait_ready(self, timeout_s: float) -> None:
        """Probe until every engine is ready; TimeoutError naming the others."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not all(e.state.ready for e in self.engines.values()):
            await self.check_all()
            if loop.time() > deadline:
                missing = [e for e, x in self.engines.items() if not x.state.ready]
                raise TimeoutError(f"engines not ready after {timeout_s}s: {missing}")
            await asyncio.sleep(0.2)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - keep probing
                logger.exception("engine health check failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.engines.values()))
        await self.register_prefill_engines()

    async def register_prefill_engines(self) -> None:
        """Tell decode engines which prefill engines they may read from. A
        new decode incarnation gets requests once it holds the list, a new
        prefill one once every answering decode engine holds it."""
        engines = list(self.engines.values())

        async def call(e: Engine, endpoints: list) -> Any:
            return await _await_ref(e.handle.actor.set_prefill_endpoints.remote(endpoints))

        decode = [e for e in engines if e.state.role == "decode" and e.answered]
        all_ok = await push_prefill_endpoints(decode, engines, call, self.call_timeout_s)
        borrowers = [  # prefill engines with a host KV tier read their peers' tiers
            e
            for e in engines
            if e.state.role == "prefill" and e.answered and e.state.info.get("kv_role") == "both"
        ]
        if borrowers:  # not needed for readiness: until then they are lent nothing
            await push_prefill_endpoints(borrowers, engines, call, self.call_timeout_s)
        lenders = [  # colocated engines with NIXL (host KV tiers): each reads the others'
            e
            for e in engines
            if e.state.role == "colocated" and e.answered and e.state.info.get("kv_address")
        ]
        if len(lenders) > 1:
            await push_prefill_endpoints(
                lenders, engines, call, self.call_timeout_s, roles=("colocated",)
            )
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

    async def check(self, e: Engine) -> None:
        """One health probe. A Ray timeout is no verdict (slow is not dead);
        death is Ray saying so or ``engine_dead_after_s`` without a heartbeat."""
        eid = e.state.engine_id
        info = None
        cause = "no heartbeat"
        try:
            info = await self.call(e, "ready")
            if self.gateway_session not in info.get("gateways", (self.gateway_session,)):
                if info.get("serving", True):
                    info = await self._join(e, info)
                else:
                    # its loop has ended (a failing or stopping engine closes every
                    # gateway's socket): no drop of this gateway, and nothing to
                    # join; its death (requests migrate) or restart decides
                    info = None
        except TimeoutError:
            # paused, starved or busy: the heartbeat decides. A join that timed out
            # leaves no answer either: ``ready``'s said this gateway is not served
            # there, so its input socket is not connected (nor it registered) yet
            info = None
        except Exception as exc:  # noqa: BLE001 - the actor died or is restarting
            if getattr(exc, "actor_init_failed", False) and not e.state.epoch:
                # never came up: a config or model error, not a crash to wait out
                raise RuntimeError(f"engine {eid} failed to start: {exc}") from exc
            e.health.mark_actor_dead()
            cause = type(exc).__name__
        if e.removed:
            return  # scaled in while the probe ran (scaling.py)
        e.answered = info is not None
        if info is not None and info["epoch"] != e.state.epoch:
            self._connect(e, info)
            if info.get("role") != e.state.role and e.state.role in ("prefill", "decode"):
                await self._restore_role(e)
        if not e.state.epoch:
            return  # not up yet
        liveness = e.health.liveness()
        if liveness is Liveness.DEAD:
            self.declare_dead(e, cause)
            return
        if e.health.orphans:  # the same incarnation is back: nothing may run for nobody
            self.num_orphans_aborted += len(e.health.orphans)
            logger.warning("engine %s is back; aborting %d orphans", eid, len(e.health.orphans))
            orphans, e.health.orphans = sorted(e.health.orphans), set()
            self.plane.send_abort(e, orphans)
        if liveness is Liveness.ALIVE:
            # stats() runs on the loop thread: ask only while it heartbeats
            try:
                self.update_stats(e, await self.call(e, "stats"))
            except Exception as exc:  # noqa: BLE001 - stale stats are not a verdict
                logger.debug("engine %s stats: %r", eid, exc)
        e.state.ready = not e.unregistered and not e.draining  # see register_prefill_engines

    async def _restore_role(self, e: Engine) -> None:
        """A restart by Ray re-ran the constructor of an engine that had moved
        (cluster/disagg/pool_move.py) with its first pool's role: it serves the
        pool it moved to (idle: nothing is sent before it registers)."""
        eid, role = e.state.engine_id, e.state.role
        ref = e.handle.actor.set_role.remote(role)
        try:
            e.state.info = await asyncio.wait_for(_await_ref(ref), self.call_timeout_s)
        except Exception as exc:  # noqa: BLE001 - it serves all the same; only its label differs
            logger.warning(
                "engine %s restarted in its first pool; set_role(%s): %r", eid, role, exc
            )
            self.errors.add(eid, f"restarted in its first pool; set_role({role}) failed", e)

    async def _join(self, e: Engine, info: dict[str, Any]) -> dict[str, Any]:
        """``e`` does not serve this gateway (yet): join it
        (``cluster/engines/attach.py``); the other gateways it serves keep
        their requests. If this gateway had been using that incarnation,
        the engine dropped it (its connection was down too long) and
        aborted its requests there: they end with an error first."""
        eid = e.state.engine_id
        if info["epoch"] == e.state.epoch and (e.state.ready or e.requests):
            logger.error("engine %s dropped this gateway; joining it again", eid)
            self.errors.add(eid, "dropped this gateway (connection down); rejoined", e)
            self.plane.fail_requests(e, f"engine {eid} dropped this gateway's requests")
        ref = e.handle.actor.join.remote(self.plane.output_addr, self.gateway_session)
        try:
            info = await asyncio.wait_for(_await_ref(ref), self.call_timeout_s)
        except asyncio.TimeoutError:
            # no verdict (the next probe asks again), but said: a gateway that never joins
            # would otherwise wait out its whole ready timeout without a line
            self.num_join_timeouts += 1
            logger.warning(
                "engine %s: joining it took over %s s (%d times); the next probe tries again",
                eid,
                self.call_timeout_s,
                self.num_join_timeouts,
            )
            raise TimeoutError(f"join took over {self.call_timeout_s} s") from None
        self.num_joins += 1
        logger.info("joined engine %s (it serves %d gateways)", eid, len(info["gateways"]))
        return info

    async def leave_all(self, timeout_s: float = 2.0) -> None:
        """A normal exit: every engine aborts this gateway's requests and
        stops sending to it (best effort: one that does not answer drops it
        when the connection stays down)."""

        async def leave(e: Engine) -> None:
            ref = e.handle.actor.leave.remote(self.gateway_session)
            await asyncio.wait_for(_await_ref(ref), timeout_s)

        engines = [e for e in self.engines.values() if e.state.epoch]
        await asyncio.gather(*(leave(e) for e in engines), return_exceptions=True)

    def declare_dead(self, e: Engine, cause: str) -> None:
        """The verdict: ``e``'s requests fail (decode streams migrate) and stay
        its orphans. Once per incarnation (``ready`` is False after it)."""
        if not e.state.ready:
            return
        eid = e.state.engine_id
        logger.warning("engine %s is dead (%s)", eid, cause)
        self.errors.add(eid, f"dead ({cause})", e)
        e.state.ready = False
        e.health.orphans.update(e.requests)
        self.plane.fail_requests(e, f"engine {eid} failed: {cause}", REASON_DEAD)

    def on_disconnect(self, engine_id: str, epoch: int) -> None:
        """The input connection to this incarnation dropped: confirm (task)."""
        e = self.engines.get(engine_id)
        if e is None or e.state.epoch != epoch or e.health.actor_dead:
            return
        task = asyncio.create_task(self._confirm_death(e, epoch))
        self.confirming.add(task)
        task.add_done_callback(self.confirming.discard)

    async def _confirm_death(self, e: Engine, epoch: int) -> None:
        """Dead on positive evidence only: its process gone (same node), else
        Ray's answer to a probe now rather than at the next health check."""
        pid = e.local_pid
        if pid is not None and await confirm_exit(pid, self.death_confirm_window_s):
            if e.state.epoch == epoch:
                e.health.mark_actor_dead()
                self.declare_dead(e, f"process {pid} exited")
            return
        try:
            await self.check(e)
        except Exception:  # noqa: BLE001 - the health loop probes again
            logger.exception("engine %s: probe after disconnect failed", e.state.engine_id)

    async def call(self, e: Engine, method: str) -> Any:
        """A control method over Ray; TimeoutError after ``call_timeout_s``."""
        ref = getattr(e.handle.actor, method).remote()
        try:
            return await asyncio.wait_for(_await_ref(ref), self.call_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{method} took over {self.call_timeout_s} s") from None

    def _connect(self, e: Engine, info: dict[str, Any]) -> None:
        """A (new) incarnation answered ready(): connect its input socket."""
        if e.state.epoch:
            self.num_engine_restarts += 1
            e.num_restarts += 1
            self.errors.add(e.state.engine_id, f"restarted (epoch {info['epoch']})", e)
            logger.warning("engine %s restarted (epoch %s)", e.state.engine_id, info["epoch"])
            self.plane.fail_requests(e, f"engine {e.state.engine_id} restarted", REASON_RESTARTED)
        self.plane.connect(e, info["input_addr"], info["epoch"])
        # its pid says "exited" only if this process can see it while it answers
        pid = info.get("pid")
        same_node = self.node_id is not None and info.get("node_id") == self.node_id
        e.local_pid = pid if same_node and pid and not process_gone(pid) else None
        e.state.epoch = info["epoch"]
        e.unregistered = e.state.role in ("prefill", "decode")
        e.state.max_num_seqs = info["max_num_seqs"]
        e.state.info = info
        e.health.reset(info["epoch"])
        self.routing.on_connected(e.state.engine_id, e.state.role, info)
        lens = [x.state.info.get("max_model_len", 0) for x in self.engines.values()]
        self.max_model_len = min(v for v in lens if v) if any(lens) else 0

    def update_stats(self, e: Engine, payload: bytes) -> None:
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


async def _await_ref(ref):
    return await ref


def ray_node_id() -> str | None:
    """This process's Ray node id (None outside Ray): engines that share it
    share this process's /proc."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no Ray context: no pid evidence
        return None
