"""An engine's switch between the prefill and decode pools (the engine side of a
pool move: cluster/disagg/pool_move.py drains it, calls this, registers it again).

Prefill work (``do_remote_decode``) and decode work (``do_remote_prefill``) are
per request, so the scheduler does not depend on the pool: what changes is the
role the engine reports (its stats, the metrics' ``role`` label, its requests'
timings). Only an engine started for pool moves may switch (``kv_pool_moves``:
its NIXL connector serves and reads whatever its pool,
``workers/parallel/connector_hook.py``), and only while it holds nothing.
"""

from __future__ import annotations

from typing import Any

MOVE_ROLES = ("prefill", "decode")


def switch_role(core: Any, role: str) -> None:
    """``core`` (an ``EngineCore``) serves in the ``role`` pool from now on. Loop
    thread only; ValueError naming ``role`` when refused (another pool, an engine
    not started for moves, one that holds anything); a refusal changes nothing."""
    config = core.config
    eid, current = config.runtime.engine_id, config.runtime.role
    if role not in MOVE_ROLES:
        raise ValueError(f"role: an engine moves to the prefill or decode pool, not {role!r}")
    if current not in MOVE_ROLES or not config.kv_transfer.pool_moves:
        raise ValueError(
            f"role: engine {eid} ({current}) was not started for pool moves "
            "(kv_pool_moves: its NIXL connector must serve and read)"
        )
    busy = busy_reason(core.scheduler)
    if busy:
        raise ValueError(f"role: engine {eid} holds {busy}; drain it before it moves")
    core.config = config.replace(role=role)
    core.request_clock.role = role


def busy_reason(scheduler: Any) -> str:
    """What the engine still holds ("" when idle): requests (blocks kept for a
    peer's read included), transfers or outputs pending."""
    if scheduler.requests:
        return f"{len(scheduler.requests)} requests"
    if scheduler.has_work():
        return "transfers or outputs pending"
    return ""
