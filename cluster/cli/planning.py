"""``--planner load|sla`` wired to a running service: the planner
(``cluster/planner/``) observes this gateway's backend and resizes its pools
with the backend's own ``PoolScaler`` (cluster/disagg/scaling.py), the code
the admin route calls.

    observation(backend)   each engine's latest figures as the gateway holds
                           them (router counters, stats), the backend's traffic
                           counters (requests arrived / ended, prompt / output tokens)
    record(decision)       PlannerState on the scaler's log: counts by
                           pool/action/reason (tandem:planner_decisions_total), the
                           latest decisions (/cluster/state, the dashboard)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tandem.cluster.gateway.backend import PlannerDecision, PlannerState
from tandem.cluster.planner.autoscale import Decision, EngineSample, Observation, make_planner
from tandem.cluster.planner.runner import PlannerRunner

MAX_RECENT = 50


def observation(backend: Any, now: float) -> Observation:
    pools: dict[str, list[EngineSample]] = {role: [] for role in backend.scaler.specs}
    for e in backend.engines.values():
        st, stats = e.state, e.stats
        info = st.info or {}
        blocks = info.get("num_kv_blocks", 0) * info.get("block_size", 0)
        pools.setdefault(st.role, []).append(
            EngineSample(
                engine_id=st.engine_id,
                ready=st.ready,
                epoch=st.epoch,
                running=st.num_running,
                waiting=st.num_waiting,
                kv_usage=st.kv_cache_usage,
                num_steps=stats.num_steps if stats is not None else 0,
                last_step_s=stats.last_step_s if stats is not None else 0.0,
                last_step_tokens=stats.last_step_num_tokens if stats is not None else 0,
                context_tokens=st.kv_cache_usage * blocks,
            )
        )
    t = backend.orchestrator.traffic
    return Observation(
        now,
        pools,
        t.arrivals,
        t.prompt_tokens,
        t.finished,
        t.output_tokens,
        t.requested_output_tokens,
    )


def start_planner(config: Any, backend: Any) -> asyncio.Task | None:
    """The planner's task on the running loop (None with ``--planner off``);
    ``config``: the ServeConfig."""
    pc = config.planning
    scaler = backend.scaler
    if pc.planner == "off" or scaler is None:
        return None
    bounds = {}
    for role in scaler.specs:
        pool = config.pools.pool(role)
        bounds[role] = (pool.min_engines, pool.max_engines)
    profile = None
    if pc.planner == "sla":
        from tandem.cluster.planner.profile import load_profile

        profile = load_profile(pc.planner_profile)
    move = pool_mover(scaler)
    planner = make_planner(pc, bounds, profile, moves=move is not None)
    state = scaler.log.planner = PlannerState(pc.planner, pc.planner_interval_s)

    def record(d: Decision) -> None:
        key = f"{d.pool}/{d.action}/{d.reason}"
        state.decisions[key] = state.decisions.get(key, 0) + 1
        row = PlannerDecision(time.time(), d.pool, d.action, d.reason, d.current, d.target,
                              dict(d.inputs))  # fmt: skip
        state.recent = [*state.recent[-(MAX_RECENT - 1) :], row]

    runner = PlannerRunner(
        planner,
        lambda: observation(backend, time.monotonic()),
        lambda pool, n: scaler.scale(pool, n, source="planner"),
        record,
        pc.planner_interval_s,
        pc.planner_watch_interval_s,
        move,
    )
    return asyncio.create_task(runner.run())


def pool_mover(scaler: Any) -> Any:
    """``move(source, destination)`` when the backend can move an engine between
    pools (a ``move_engine(source, destination, source=...)`` on its scaler, and
    the service's pools alike: ``moves_off`` None; cluster/disagg/pool_move.py),
    else None: then the planner asks for no move, only a stop and a start."""
    move_engine = getattr(scaler, "move_engine", None)
    if move_engine is None or getattr(scaler, "moves_off", None) is not None:
        return None
    return lambda pool, dest: move_engine(pool, dest, source="planner")
