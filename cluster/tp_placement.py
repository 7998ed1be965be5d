"""An engine's placement group: one bundle per tensor-parallel rank.

    GPU engine, num_gpus G, tensor_parallel_size N (STRICT_PACK: one node)
      bundle 0: {GPU: G/N, CPU: 1, **resources}   engine actor (scheduler + rank 0)
      bundle r: {GPU: G/N, CPU: 1}                rank r's worker actor, r = 1..N-1

    CPU engine with N > 1 (no GPU to hold: the ranks share the node's cores)
      bundle r: {CPU: CPU_RANK_SHARE} (+ resources on bundle 0)

A CPU engine with N = 1 keeps no group (``engine_actor_placement``). The
engine actor asks for bundle 0's GPUs; ``workers/parallel/ray_workers.py``
starts rank r in bundle r. ``G/N`` must be a whole number (NCCL wants one
GPU per rank): 3 GPUs, or half a GPU, for 2 ranks is refused.
"""

from __future__ import annotations

from typing import Any

from cluster.placement import engine_actor_placement

# a bundle may not be empty: CPU ranks hold a token share of a core (they
# share the node's cores, as CPU engine actors ask for no CPU)
CPU_RANK_SHARE = 0.01


def per_rank_gpus(num_gpus: float, tp_size: int, field: str = "num_gpus_per_engine") -> int:
    """Whole GPUs of one rank's bundle; ValueError naming ``field`` when they do not split."""
    per = num_gpus / tp_size
    if not float(per).is_integer() or per < 1:
        raise ValueError(
            f"{field} ({num_gpus}) does not split into {tp_size} equal whole GPUs "
            f"(tensor_parallel_size {tp_size}): use a multiple of {tp_size}"
        )
    return int(per)


def engine_group_placement(
    num_gpus: int | float, resources: dict[str, float], tp_size: int
) -> tuple[dict[str, Any], list[dict[str, float]] | None]:
    """``(engine actor options, bundles or None)``: see the module doc."""
    options, bundle = engine_actor_placement(num_gpus, resources)
    if tp_size == 1:
        return options, None if bundle is None else [bundle]
    if bundle is None:  # CPU
        first = {"CPU": CPU_RANK_SHARE, **resources}
        return options, [first] + [{"CPU": CPU_RANK_SHARE} for _ in range(tp_size - 1)]
    per = per_rank_gpus(num_gpus, tp_size)
    options["num_gpus"] = per
    return options, [{**bundle, "GPU": per}] + [{"GPU": per, "CPU": 1} for _ in range(tp_size - 1)]
