"""Pools that resize while serving: engines come and go without losing a stream.

    POST /admin/pools/{role} {"engines": N}, tandem scale, the planner
      -> PoolScaler.scale(role, N)     one resize at a time; N inside the pool's
                                       --{role}-min-engines / --{role}-max-engines
    scale out, per new engine:
      start_engine (cluster/engines/pools.py): a Ray actor with the pool's
        resources (on KubeRay its request makes the autoscaler add a pod)
      wait for its ready() (--scale-start-timeout-s; past it, or if its
        constructor fails, it is stopped and the start reported failed)
      only then RayBackend.add_engine: the health probe connects it as at
        start (input socket, KV events, prefix index) and marks it ready once
        the prefill registry holds it (a prefill engine: every decode engine
        knows it; a decode engine: it holds the list)
    scale in, per removed engine (idle or least loaded first, newest first):
      drain.drain: no new work; decode / colocated streams migrate
        token-identically; a prefill engine's handoffs in flight finish
        (--scale-drain-timeout-s)
      RayBackend.remove_engine: out of the router, the prefix index, the KV
        event subscription and the prefill registry (the next push)
      stop the actor (and its placement group)

Every start and stop is counted by ``(pool, action, outcome)`` and kept in a
short log (``/cluster/state``, ``tandem:scaling_actions_total``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from tandem.cluster.disagg import drain
from tandem.cluster.disagg.engine import Engine, cause_text, engine_index
from tandem.cluster.engines.placement import PoolsConfig
from tandem.cluster.engines.pools import (
    EngineHandle,
    PoolSpec,
    default_torch_threads,
    name_taken,
    start_engine,
    stop_pools,
)
from tandem.cluster.gateway.backend import PlannerState, ScalingEvent

logger = logging.getLogger(__name__)

SCALE_OUT, SCALE_IN = "scale_out", "scale_in"  # and "move": pool_move.py


class ScalingLog:
    """Counters and the latest actions, read by ``metrics_snapshot``."""

    def __init__(self, maxlen: int = 50) -> None:
        self.actions: dict[tuple[str, str, str], int] = {}
        self.events: collections.deque[ScalingEvent] = collections.deque(maxlen=maxlen)
        self.planner: PlannerState | None = None  # written by the planner's runner

    def record(self, pool: str, action: str, outcome: str, engine_id: str = "", detail: str = "",
               source: str = "admin") -> None:  # fmt: skip
        key = (pool, action, outcome)
        self.actions[key] = self.actions.get(key, 0) + 1
        self.events.append(
            ScalingEvent(time.time(), pool, action, outcome, engine_id, detail, source)
        )
        log = logger.warning if outcome != "ok" else logger.info
        log("pool %s: %s %s %s (%s) %s", pool, action, engine_id or "-", outcome, source, detail)

    def counts(self) -> dict[str, int]:
        return {"/".join(k): n for k, n in sorted(self.actions.items())}


class PoolScaler:
    def __init__(
        self,
        backend: Any,  # RayBackend (ray_backend.py imports this module)
        specs: list[PoolSpec],
        pools: PoolsConfig,
        *,
        output_addr: str,
        namespace: str,
        gateway_session: int,
        detached: bool = False,
        owner: bool = True,
        moves_off: str | None = "not configured",
    ) -> None:
        """``specs``: the running pools' specs (what a new engine gets);
        ``pools``: their bounds and the timeouts. ``owner``: this gateway
        started the engines (not ``--attach``): only then may it resize.
        ``moves_off``: why an engine may not move between the prefill and
        decode pools (``ServeConfig.pool_moves_off()``), None when it may."""
        self.backend = backend
        self.specs = {s.role: s for s in specs}
        self.pools = pools
        self.output_addr = output_addr
        self.namespace = namespace
        self.gateway_session = gateway_session
        self.detached = detached
        self.owner = owner
        self.moves_off = moves_off
        self.log = ScalingLog()
        self.starting: dict[str, EngineHandle] = {}  # engine id -> started, not yet ready
        self._lock = asyncio.Lock()

    # ---- the resize ------------------------------------------------------------

    def members(self, role: str) -> list[Engine]:
        return [e for e in self.backend.engines.values() if e.state.role == role]

    def check(self, role: str, engines: int, source: str = "admin") -> None:
        """ValueError naming the field when a resize of ``role`` to ``engines`` is refused."""
        if role not in self.specs:
            raise ValueError(
                f"pool: no {role!r} pool runs here (running: {', '.join(sorted(self.specs))})"
            )
        if not self.owner:
            raise ValueError(
                "pool: this gateway adopted its engines (--attach); resize from the "
                "process that started them"
            )
        if isinstance(engines, bool) or not isinstance(engines, int):
            raise ValueError(f"engines: an integer, got {engines!r}")
        why = self.pools.pool(role).bounds_error(engines)
        if why is not None:
            action = SCALE_OUT if engines > len(self.members(role)) else SCALE_IN
            self.log.record(role, action, "refused", detail=why, source=source)
            raise ValueError(why)

    async def scale(self, role: str, engines: int, source: str = "admin") -> dict[str, Any]:
        """Resize ``role`` to ``engines`` (module doc). One resize at a time;
        returns what was started, stopped and what failed."""
        self.check(role, engines, source)
        async with self._lock:
            before = len(self.members(role))
            started: list[str] = []
            stopped: list[dict[str, Any]] = []
            failed: list[dict[str, str]] = []
            if engines > before:
                results = await asyncio.gather(
                    *(self._start_one(role, source) for _ in range(engines - before))
                )
                for eid, error in results:
                    if error is None:
                        started.append(eid)
                    else:
                        failed.append({"engine_id": eid, "error": error})
            for e in self._victims(role, before - engines):
                stopped.append(await self._stop_one(e, source))
            return {
                "pool": role,
                "before": before,
                "engines": len(self.members(role)),
                "started": started,
                "stopped": stopped,
                "failed": failed,
            }

    async def move_engine(self, source_pool: str, dest_pool: str, source: str = "admin",
                          engine_id: str | None = None) -> dict[str, Any]:  # fmt: skip
        """Move one engine of ``source_pool`` (``engine_id``, else the least
        loaded) to ``dest_pool`` while serving (``pool_move.py``): drained,
        switched, registered again. ValueError naming the field when refused."""
        from tandem.cluster.disagg import pool_move

        pool_move.check_move(self, source_pool, dest_pool, engine_id, source)
        async with self._lock:
            pool_move.check_move(self, source_pool, dest_pool, engine_id, source)  # still so
            return await pool_move.move_engine(self, source_pool, dest_pool, engine_id, source)

    # ---- scale out -------------------------------------------------------------

    def _free_index(self, role: str) -> int:
        used = {e.state.engine_id for e in self.members(role)} | set(self.starting)
        i = 0
        while f"{role}-{i}" in used or name_taken(f"{role}-{i}", self.namespace):
            i += 1
        return i

    async def _start_one(self, role: str, source: str) -> tuple[str, str | None]:
        spec = self.specs[role]
        index = self._free_index(role)
        total = sum(len(self.members(r)) for r in self.specs) + len(self.starting) + 1
        handle = start_engine(
            spec,
            index,
            self.output_addr,
            self.namespace,
            self.gateway_session,
            self.detached,
            default_torch_threads(total),
        )
        eid = handle.engine_id
        self.starting[eid] = handle
        try:
            error = await self._wait_up(handle)
        finally:
            self.starting.pop(eid, None)
        if error is not None:
            await asyncio.to_thread(stop_pools, [handle])
            self.log.record(role, SCALE_OUT, "failed", eid, error, source)
            return eid, error
        self.log.record(role, SCALE_OUT, "ok", eid, source=source)
        return eid, None

    async def _wait_up(self, handle: EngineHandle) -> str | None:
        """The new actor's ready(), then its join as at start; None when
        it serves, else why not."""
        timeout_s = self.pools.scale_start_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await asyncio.wait_for(_await_ref(handle.actor.ready.remote()), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return (
                f"not placed and ready within {timeout_s:.0f} s (--scale-start-timeout-s): "
                "no node offers the pool's resources?"
            )
        except Exception as exc:  # noqa: BLE001 - its constructor failed, or it died
            return f"failed to start: {cause_text(exc)}"
        e = self.backend.add_engine(handle)
        members = self.backend.members
        while not e.state.ready:
            if loop.time() > deadline:
                self.backend.remove_engine(e.state.engine_id)
                return f"not registered within {timeout_s:.0f} s (--scale-start-timeout-s)"
            try:
                await members.check(e)
                await members.register_prefill_engines()
            except Exception as exc:  # noqa: BLE001 - it died while joining
                self.backend.remove_engine(e.state.engine_id)
                return f"failed while joining: {cause_text(exc)}"
            if not e.state.ready:
                await asyncio.sleep(0.1)
        return None

    # ---- scale in --------------------------------------------------------------

    def _victims(self, role: str, count: int) -> list[Engine]:
        """Engines to remove: not serving first, then the least loaded, newest first."""
        if count <= 0:
            return []

        def key(e: Engine) -> tuple:
            held = e.state.num_inflight if role == "prefill" else len(e.requests)
            return (e.state.ready, held + e.state.queued_prefill_tokens, -engine_index(e))

        return sorted(self.members(role), key=key)[:count]

    async def _stop_one(self, e: Engine, source: str) -> dict[str, Any]:
        eid, role = e.state.engine_id, e.state.role
        in_flight = {
            "streams": len(e.requests) if role != "prefill" else 0,
            "prefills": e.state.num_inflight if role == "prefill" else 0,
            "blocks_held": e.stats.scheduler.num_blocks_held_for_transfer if e.stats else 0,
        }
        timeout_s = self.pools.scale_drain_timeout_s
        try:
            result = await drain.drain(self.backend.members, self.backend.plane, eid, timeout_s)
        except Exception as exc:  # noqa: BLE001 - stop it anyway; its streams moved
            result = {"idle": False, "migrated": 0, "error": cause_text(exc)}
        self.backend.remove_engine(eid)
        await asyncio.to_thread(stop_pools, [e.handle])
        detail = "" if result.get("idle") else "not idle at the drain deadline"
        outcome = "ok" if result.get("idle") else "failed"
        self.log.record(role, SCALE_IN, outcome, eid, detail, source)
        return {
            "engine_id": eid,
            "idle": bool(result.get("idle")),
            "migrated": result.get("migrated", 0),
            "in_flight": in_flight,
        }

    async def close(self) -> None:
        """Stop engines still starting (their resize is cancelled with the gateway)."""
        handles = list(self.starting.values())
        self.starting.clear()
        if handles:
            await asyncio.to_thread(stop_pools, handles)


async def _await_ref(ref: Any) -> Any:
    return await ref
