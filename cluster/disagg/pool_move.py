"""A pool move: a running engine leaves one pool and serves in the other.

    POST /admin/pools/move {"source_pool", "dest_pool"(, "engine_id")},
    tandem scale --move decode:prefill, the sla planner (cluster/planner/moves.py)
      -> PoolScaler.move_engine(source_pool, dest_pool, source=...)
         (one resize or move at a time: the scaler's lock)

    check        moves on for this service (cluster/engines/pool_moves.py:
                 otherwise 400 naming why), the source pool keeps its
                 --{pool}-min-engines (its last engine never moves), the
                 destination stays within --{pool}-max-engines
    pick         the given engine, else the source's ready engine holding
                 the least (one named after the destination first: it came
                 from there; then the newest, as a scale-in picks)
    drain        drain.drain as a scale-in: no new work; decode streams
                 migrate token-identically; a prefill engine's handoffs in
                 flight finish (--scale-drain-timeout-s)
    switch       actor.set_role(dest): the engine refuses unless idle
    re-register  the same actor, the same record (Engine): its router pool,
                 its prefix index role (its cached blocks stay indexed: they
                 are still there), its handle's and stats' role; then, as a
                 new engine joins, unregistered until the prefill registry
                 exchange of its new pool: a decode engine once it holds the
                 list, a prefill engine once every decode engine holds it
                 (as a "both" engine it was listed already) -> ready

A failure leaves a consistent state, never a half-registered engine:

    drain not idle in time, or the switch refused   undrained, serving in
                                                    its old pool
    the switch did not answer (timeout, died)       set_role(old) tried; the
                                                    record never changed, so
                                                    it is in its old pool and
                                                    the health probe judges it
    re-registration not done in time                set_role(old) and back in
                                                    the old pool; failing
                                                    that, removed and stopped

Each move is recorded as ``(dest_pool, "move", outcome)`` in the scaling log
(``tandem:scaling_actions_total``, ``/cluster/state``'s ``scaling``, the
detail naming both pools) and answers the time of each phase.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from tandem.cluster.disagg import drain
from tandem.cluster.disagg.engine import Engine, cause_text, engine_index
from tandem.cluster.engines.pool_moves import MOVE_ROLES
from tandem.cluster.engines.pools import stop_pools

MOVE = "move"


def check_move(scaler: Any, source_pool: str, dest_pool: str, engine_id: str | None,
               source: str = "admin") -> None:  # fmt: skip
    """ValueError naming the field when the move is refused (counted ``refused``
    when the pools are known)."""
    for field, pool in (("source_pool", source_pool), ("dest_pool", dest_pool)):
        if pool not in MOVE_ROLES:
            raise ValueError(f"{field}: engines move between prefill and decode, not {pool!r}")
    if source_pool == dest_pool:
        raise ValueError(f"dest_pool: the engine is in the {source_pool} pool already")

    def refuse(why: str) -> None:
        scaler.log.record(dest_pool, MOVE, "refused", engine_id or "", why, source)
        raise ValueError(why)

    if not scaler.owner:
        refuse(
            "pool: this gateway adopted its engines (--attach); move from the one that started them"
        )
    if scaler.moves_off is not None:
        refuse(f"pool_moves: engines do not move between this service's pools: {scaler.moves_off}")
    members = scaler.members(source_pool)
    for role, n in (
        (source_pool, len(members) - 1),
        (dest_pool, len(scaler.members(dest_pool)) + 1),
    ):
        why = scaler.pools.pool(role).bounds_error(n)
        if why is not None:
            refuse(f"{'source_pool' if role == source_pool else 'dest_pool'}: {why}")
    if engine_id is not None:
        e = scaler.backend.engines.get(engine_id)
        if e is None or e.state.role != source_pool:
            refuse(f"engine_id: no {source_pool} engine {engine_id!r} "
                   f"(have {sorted(x.state.engine_id for x in members)})")  # fmt: skip
        if not e.state.ready:
            refuse(f"engine_id: {engine_id} is not serving (starting, drained or dead)")
    elif not any(e.state.ready for e in members):
        refuse(f"source_pool: no {source_pool} engine is serving")


def pick(members: list[Engine], engine_id: str | None, dest_pool: str) -> Engine:
    """The given engine, else the ready one holding the least; among equals one
    whose name is the destination's (it moved away before: names stay tidy),
    then the newest."""
    if engine_id is not None:
        return next(e for e in members if e.state.engine_id == engine_id)
    ready = [e for e in members if e.state.ready]

    def key(e: Engine) -> tuple:
        held = e.state.num_inflight if e.state.role == "prefill" else len(e.requests)
        named_elsewhere = not e.state.engine_id.startswith(dest_pool + "-")
        return (held + e.state.queued_prefill_tokens, named_elsewhere, -engine_index(e))

    return min(ready, key=key)


async def move_engine(scaler: Any, source_pool: str, dest_pool: str, engine_id: str | None,
                      source: str) -> dict[str, Any]:  # fmt: skip
    """The move (module doc); the caller holds the scaler's lock and checked it."""
    backend = scaler.backend
    e = pick(scaler.members(source_pool), engine_id, dest_pool)
    eid = e.state.engine_id
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    result: dict[str, Any] = {
        "engine_id": eid, "source_pool": source_pool, "dest_pool": dest_pool,
        "moved": False, "migrated": 0, "error": None,
    }  # fmt: skip
    timeout_s = scaler.pools.scale_drain_timeout_s
    try:
        drained = await drain.drain(backend.members, backend.plane, eid, timeout_s)
    except Exception as exc:  # noqa: BLE001 - it stays where it is
        drained = {"idle": False, "error": cause_text(exc)}
    result["migrated"] = drained.get("migrated", 0)
    result["drain_s"] = loop.time() - t0
    if not drained.get("idle"):
        why = drained.get("error") or "not idle at the drain deadline (--scale-drain-timeout-s)"
        return _timed(_back(scaler, e, result, why, source), t0, loop)
    t1 = loop.time()
    try:
        info = await _set_role(backend, e, dest_pool)
    except ValueError as exc:  # the engine refused: it holds work again
        return _timed(_back(scaler, e, result, str(exc), source), t0, loop)
    except Exception as exc:  # noqa: BLE001 - no answer: put the engine's role back
        await _restore(backend, e, source_pool)
        return _timed(
            _back(scaler, e, result, f"switch failed: {cause_text(exc)}", source), t0, loop
        )
    result["switch_s"] = loop.time() - t1
    t2 = loop.time()
    rejoin(backend, e, dest_pool, info)
    error = await _wait_registered(backend, e, loop.time() + scaler.pools.scale_start_timeout_s)
    if error is not None:
        result["error"] = error
        try:
            rejoin(backend, e, source_pool, await _set_role(backend, e, source_pool))
            error = await _wait_registered(backend, e, loop.time() + timeout_s)
        except Exception as exc:  # noqa: BLE001
            error = cause_text(exc)
        if error is not None:  # neither pool takes it: out, and stopped
            backend.remove_engine(eid)
            await asyncio.to_thread(stop_pools, [e.handle])
            result["error"] += f"; not back in the {source_pool} pool either ({error}): stopped"
        scaler.log.record(dest_pool, MOVE, "failed", eid, result["error"], source)
        return _timed(result, t0, loop)
    result["register_s"] = loop.time() - t2
    result["moved"] = True
    scaler.log.record(dest_pool, MOVE, "ok", eid, f"{source_pool} -> {dest_pool}", source)
    return _timed(result, t0, loop)


def rejoin(backend: Any, e: Engine, role: str, info: dict[str, Any]) -> None:
    """The same engine's record under pool ``role``, not yet serving: the next
    registry exchange marks it ready (membership.py)."""
    e.state.ready = False
    e.state.role = role
    e.handle.role = role
    e.state.info = info
    e.unregistered = True
    e.pushed_endpoints = None
    e.draining = False
    # drained and idle, it owes nothing; a prefill engine still lists the streams it
    # prefilled (for aborts of blocks it no longer holds): in the decode pool a drain or
    # a death would take them for its own streams and fail them where they run
    e.requests.clear()
    if e.stats is not None:
        e.stats = msgspec.structs.replace(e.stats, role=role)
    backend.routing.on_moved(e.state.engine_id, role, info)


async def _wait_registered(backend: Any, e: Engine, deadline: float) -> str | None:
    loop = asyncio.get_running_loop()
    members = backend.members
    while not e.state.ready:
        if e.removed or loop.time() > deadline:
            return f"not registered in the {e.state.role} pool in time"
        try:
            await members.check(e)
            await members.register_prefill_engines()
        except Exception as exc:  # noqa: BLE001 - it died while joining
            return f"failed while joining the {e.state.role} pool: {cause_text(exc)}"
        if not e.state.ready:
            await asyncio.sleep(0.02)
    return None


async def _set_role(backend: Any, e: Engine, role: str) -> dict[str, Any]:
    """The actor's ``set_role``; its ValueError (a refusal) raised as one."""
    ref = e.handle.actor.set_role.remote(role)
    try:
        return await asyncio.wait_for(_await_ref(ref), backend.members.call_timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"set_role took over {backend.members.call_timeout_s} s") from None
    except Exception as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ValueError):
            raise ValueError(str(cause)) from None
        raise


async def _restore(backend: Any, e: Engine, role: str) -> None:
    try:
        await _set_role(backend, e, role)
    except Exception:  # noqa: BLE001 - the health probe judges it; a restart restores it
        pass


def _back(
    scaler: Any, e: Engine, result: dict[str, Any], error: str, source: str
) -> dict[str, Any]:
    """The move did not happen: the engine serves on in its pool."""
    drain.undrain(scaler.backend.engines, e.state.engine_id)
    result["error"] = error
    scaler.log.record(result["dest_pool"], MOVE, "failed", e.state.engine_id, error, source)
    return result


def _timed(result: dict[str, Any], t0: float, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    result["total_s"] = loop.time() - t0
    return result


async def _await_ref(ref: Any) -> Any:
    return await ref
