"""Drain: an operator takes an engine out of service without failing a stream.

    POST /admin/drain {"engine_id"}  (cluster/gateway/api/admin.py, tandem drain)
      -> no new work on it (not ready, draining)
      -> decode / colocated: its streams migrate now (migration.py, reason "drain");
         prefill: its short requests finish
      -> wait until it holds nothing (its stats say idle, and no output is
         owed: a prefill engine's handoffs in flight finish), at most timeout_s
    POST /admin/undrain -> ready again once healthy

A drained engine stays connected and probed; only the router skips it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.cluster.disagg.data_plane import DataPlane
from tandem.cluster.disagg.engine import Engine
from tandem.cluster.disagg.membership import Membership
from tandem.cluster.disagg.migration import REASON_DRAIN
from tandem.scheduler.engine_stats import STATS_DECODER

# an engine whose stats show none of these holds no request (drain: idle)
BUSY_STATS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_for_remote_kvs",
    "num_blocks_held_for_transfer",
)


async def drain(
    members: Membership, plane: DataPlane, engine_id: str, timeout_s: float
) -> dict[str, Any]:
    """Stop new work on ``engine_id``, migrate its streams away (decode /
    colocated; a prefill engine's short requests finish), wait until it
    holds none. ValueError for an unknown id."""
    e = _engine(members.engines, engine_id)
    e.draining = True
    e.state.ready = False
    moved = 0
    if e.state.role != "prefill" and e.requests:
        moved = len(e.requests)
        plane.send_abort(e, sorted(e.requests))
        plane.fail_requests(e, f"engine {engine_id} drained", REASON_DRAIN)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    idle = False
    while loop.time() < deadline:
        try:
            stats = STATS_DECODER.decode(await members.call(e, "stats")).scheduler
        except Exception:  # noqa: BLE001 - slow or dead: holds nothing of ours soon
            stats = None
        if (
            _nothing_owed(e)
            and stats is not None
            and not any(getattr(stats, k) for k in BUSY_STATS)
        ):
            idle = True
            break
        await asyncio.sleep(0.1)
    return {"engine_id": engine_id, "draining": True, "migrated": moved, "idle": idle}


def _nothing_owed(e: Engine) -> bool:
    """No request of ours is still owed an output by ``e``. A prefill engine
    owes one output per prefill sent (``num_inflight`` drops when it came
    back, with the KV handoff's params); the request itself stays listed
    there until its stream ends, for aborts of its held blocks, which the
    engine's stats show (``num_blocks_held_for_transfer``). Other engines
    owe outputs to every stream they hold."""
    if e.state.role == "prefill":
        return e.state.num_inflight == 0
    return not e.requests


def undrain(engines: dict[str, Engine], engine_id: str) -> dict[str, Any]:
    """Let a drained engine take new work again (once healthy)."""
    e = _engine(engines, engine_id)
    e.draining = False
    return {"engine_id": engine_id, "draining": False}


def _engine(engines: dict[str, Engine], engine_id: str) -> Engine:
    e = engines.get(engine_id)
    if e is None:
        raise ValueError(f"engine_id: no engine {engine_id!r} (have {sorted(engines)})")
    return e
