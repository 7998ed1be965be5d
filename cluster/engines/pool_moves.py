"""May an engine move between the prefill and decode pools of this service?

A move (``cluster/disagg/pool_move.py``) keeps the engine's process: its
weights, its KV cache, its placement and every engine setting it started
with. So a service moves engines only where that is the same thing as
starting one in the other pool:

    both pools run (a prefill and a decode pool; a colocated pool never moves)
    the same GPUs and Ray resources per engine (--{pool}-num-gpus-per-engine,
        --{pool}-ray-resources: a KubeRay deployment pinning each pool to its
        worker group keeps its pools apart)
    the same engine settings (every key of --{pool}-X: tensor-parallel size,
        KV blocks, batch limits, tiers, ...), apart from what tandem serve sets
        per pool itself (the role, kv_borrows_tiers)
    --pool-moves on (the default)

Where they hold, ``tandem serve`` starts every prefill and decode engine with
``kv_pool_moves`` (its NIXL connector serves and reads: role "both",
``workers/parallel/connector_hook.py``), so a switch needs no new agent.
Where one fails, moves stay off and ``/cluster/state`` says why
(``pool_moves``); the planner then plans a stop and a start instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MOVE_ROLES = ("prefill", "decode")
# set per pool by tandem serve itself, not by the operator
_PER_POOL_BY_SERVE = frozenset({"role", "kv_borrows_tiers", "kv_pool_moves"})


def moves_blocker(pools: Any, engine_of: Callable[[str], Any], enabled: bool = True) -> str | None:
    """Why the pools' engines may not move (None: they may). ``pools``: the
    serve configuration's ``PoolsConfig``; ``engine_of(role)``: the prefill or
    decode pool's ``EngineConfig`` before ``kv_pool_moves`` is set, asked only
    once both pools run (a colocated service's settings, e.g. tiers under
    tensor parallelism, may not make a valid prefill engine)."""
    if not enabled:
        return "pool moves are off (--no-pool-moves)"
    sizes = pools.sizes()
    if sizes.get("colocated") or not all(sizes.get(r) for r in MOVE_ROLES):
        return "moves need a prefill and a decode pool (a colocated pool does not move)"
    (gpus_p, res_p), (gpus_d, res_d) = (pools.placement(r) for r in MOVE_ROLES)
    if gpus_p != gpus_d:
        return (
            f"the pools' engines hold different GPUs (prefill {gpus_p}, decode {gpus_d}: "
            "--prefill-num-gpus-per-engine / --decode-num-gpus-per-engine)"
        )
    if res_p != res_d:
        return (
            f"the pools ask Ray for different resources (prefill {res_p}, decode {res_d}: "
            "--prefill-ray-resources / --decode-ray-resources)"
        )
    flat_p, flat_d = (engine_of(r).flat() for r in MOVE_ROLES)
    for key in flat_p:
        if key in _PER_POOL_BY_SERVE or flat_p[key] == flat_d.get(key):
            continue
        return (
            f"the pools' engines differ in {key} (prefill {flat_p[key]!r}, decode "
            f"{flat_d.get(key)!r}: --prefill-{key.replace('_', '-')} / "
            f"--decode-{key.replace('_', '-')}); a moved engine would keep its own"
        )
    return None
