"""Pool moves: an engine leaves one pool and joins the other without a restart.

A move is its own action, beside scale out (a new engine: actor start,
weight load, registry exchange: the cold start) and scale in (drain, stop).
The moving engine drains as a scale-in does (no new work; a decode
engine's streams migrate token-identically, a prefill engine's handoffs in
flight finish), then serves in the other pool with the weights it already
holds: its cost is the drain and the re-registration, not a cold start.

The sla planner (``SlaPlanner(..., moves=True)``) plans both pools with the
performance model as before (sla.py: each pool's count, hysteresis on the way
in, cooldowns), then ``pair`` turns a pool that grows beside one that
shrinks into moves: ``min(growth, shrink)`` engines change pool instead of
one pool stopping engines while the other starts new ones. A pool shrinks
only when the model says its survivors meet its SLO (with the scale-in
margin), so a move never takes an engine the source pool needs; the
source's scale-in cooldown and the watch's rule (a pool that breaches never
shrinks) hold for a move as for a scale-in. What is left of either change
stays a scale out or a scale in.

Each side of a move is a ``Decision`` of its pool: ``move_in`` (the growing
pool) and ``move_out`` (the shrinking one), ``moved`` engines of the change
coming from (going to) the other pool, ``target`` the pool's size after the
whole change. ``plan`` orders what an actuator does: the moves, then the
scale-ins, then the scale-outs.

Only a deployment that can move an engine asks for moves: the simulator
(elastic.py, ``switch_s``) can; the running service can where its prefill and
decode engines are alike (cluster/engines/pool_moves.py: then they start with
NIXL role "both" and cluster/disagg/pool_move.py moves one), so
``cluster/cli/planning.py`` asks for moves only from a scaler whose
``moves_off`` is None (``pool_mover``); otherwise a change is a stop and a start.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCALE_OUT, SCALE_IN, HOLD = "scale_out", "scale_in", "hold"
MOVE_IN, MOVE_OUT = "move_in", "move_out"


def pair(decisions: list[Any]) -> list[Any]:
    """``decisions`` (one per pool) with a growing pool's change taken from a
    shrinking pool's surplus first (module doc)."""
    grow = [d for d in decisions if d.target > d.current]
    shrink = [d for d in decisions if d.target < d.current]
    if len(grow) != 1 or len(shrink) != 1:
        return decisions
    g, s = grow[0], shrink[0]
    k = min(g.target - g.current, s.current - s.target)
    moved = {
        g.pool: dataclasses.replace(g, action=MOVE_IN, moved=k, source=s.pool),
        s.pool: dataclasses.replace(s, action=MOVE_OUT, moved=k, source=s.pool),
    }
    return [moved.get(d.pool, d) for d in decisions]


def plan(decisions: list[Any], can_move: bool = True) -> list[tuple[str, str, Any]]:
    """What to do, in order: ``("move", source, destination)`` once per moved
    engine, then ``("scale", pool, size)`` for each pool whose size changes
    beyond its moves (scale-ins first, so a pool that grows finds the room).
    ``can_move=False``: every change is a scale (a stop and a start)."""
    steps: list[tuple[str, str, Any]] = []
    for d in decisions:
        if can_move and d.action == MOVE_IN:
            steps += [("move", d.source, d.pool)] * d.moved
    rest = []
    for d in decisions:
        if d.action == HOLD:
            continue
        after_moves = d.current
        if can_move and d.action == MOVE_IN:
            after_moves += d.moved
        elif can_move and d.action == MOVE_OUT:
            after_moves -= d.moved
        if d.target != after_moves:
            rest.append((d.target > after_moves, d.pool, d.target))
    steps += [("scale", pool, n) for _, pool, n in sorted(rest)]
    return steps
