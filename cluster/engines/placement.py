"""Where a pool's engines may run: per-pool Ray resources and GPU counts.

On a cluster whose nodes are split into groups (KubeRay worker groups
``prefill`` and ``decode``), each group advertises a custom Ray resource
(``ray start --resources '{"tandem_prefill": 2}'``) and every engine of a pool
asks for one unit of it, so Ray places prefill engines only on prefill nodes::

    tandem serve --prefill 4 --prefill-ray-resources '{"tandem_prefill": 1}' \\
                 --decode 4  --decode-ray-resources  '{"tandem_decode": 1}'

``--<pool>-num-gpus-per-engine`` overrides ``--num-gpus-per-engine`` for one
pool (prefill engines with 2 GPUs, decode engines with 1). A fraction packs
engines onto one GPU (``--num-gpus-per-engine 0.5``: a prefill and a decode
engine share a GPU); Ray then gives both the same device, and each engine
sizes its KV cache from its own ``--<pool>-gpu-memory-utilization``, which
defaults to 0.9 x its fraction and may not exceed it (``gpu_share``)::

    one GPU, --num-gpus-per-engine 0.5
    +---------------------------------------------+------+
    | prefill-0: 0.45 of memory | decode-0: 0.45  | 0.10 |  CUDA contexts,
    +---------------------------------------------+------+  activations

Tensor parallelism: an engine's placement group holds one bundle per rank
(``engine_group_placement``)::

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

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tandem.wire.config_fields import json_text, option

ROLES = ("prefill", "decode", "colocated")
# Ray takes these through num_cpus / num_gpus / memory, never in ``resources``.
_RESERVED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def parse_ray_resources(value: Any, field: str) -> dict[str, float]:
    """A ``{name: amount}`` mapping from a dict or a JSON object string.

    Raises ValueError naming ``field`` for bad JSON, a non-object, a name Ray
    reserves (CPU, GPU, memory) or an amount that is not a finite number >= 0.
    """
    if value is None or value == "":
        return {}
    value = json_text(value, field)
    if not isinstance(value, dict):
        raise ValueError(f'{field}: expected a JSON object like {{"tandem_prefill": 1}}')
    out: dict[str, float] = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{field}: resource names must be non-empty strings")
        if name in _RESERVED_RESOURCES:
            raise ValueError(
                f"{field}: {name!r} is set by Ray itself; use --num-gpus-per-engine for GPUs"
            )
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"{field}: amount of {name!r} must be a number, got {amount!r}")
        if not math.isfinite(amount) or amount < 0:
            raise ValueError(f"{field}: amount of {name!r} must be >= 0, got {amount!r}")
        out[name] = float(amount)
    return out


def check_num_gpus(value: Any, key: str) -> int | float:
    """GPUs per engine: 0 (CPU), a fraction in (0, 1] (engines share a GPU)
    or a whole number >= 1. Whole numbers come back as ``int``. Raises
    ValueError naming ``key`` and its flag."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} ({flag}) must be a number, got {value!r}")
    if value < 0 or (value > 1 and not float(value).is_integer()):
        raise ValueError(
            f"{key} ({flag}) must be 0 (CPU), a fraction in (0, 1] (engines share a GPU) "
            f"or a whole number >= 1, got {value!r}"
        )
    return int(value) if float(value).is_integer() else float(value)


def gpu_share(num_gpus: float, overrides: dict[str, Any], role: str) -> dict[str, Any]:
    """Engine overrides of a pool with ``num_gpus`` per engine, completed for
    GPU sharing: with a fraction, ``gpu_memory_utilization`` defaults to
    0.9 x the fraction, and an explicit one above the fraction is refused
    (engines packed on one GPU would ask for more memory than it has).
    ``overrides`` holds what was given: the serve configuration passes its
    engine section's value only when it is not the field's default."""
    if not 0 < num_gpus < 1:
        return overrides
    from tandem.workers.config import engine_leaf

    default = engine_leaf("gpu_memory_utilization").default
    util = overrides.get("gpu_memory_utilization")
    if util is None:
        return {**overrides, "gpu_memory_utilization": default * num_gpus}
    if isinstance(util, (int, float)) and util > num_gpus:
        raise ValueError(
            f"{role}_gpu_memory_utilization (--{role}-gpu-memory-utilization or "
            f"--gpu-memory-utilization) is {util} but a {role} engine holds only {num_gpus} "
            f"of a GPU ({role}_num_gpus_per_engine): engines sharing the GPU would ask for "
            "more memory than it has"
        )
    return overrides


# ---- the pools section of the serve configuration (cluster/cli/config/) --------------


@dataclass(frozen=True)
class PoolConfig:
    """One engine pool: how many engines, where they run, and the engine
    settings of this pool alone (``engine``: EngineConfig field -> value, over
    the engine section every pool shares). ``{role}`` in a key or help is the
    pool's name: keys ``decode``, ``decode_num_gpus_per_engine``, ..."""

    role: str = option("colocated", internal=True, help="prefill | decode | colocated")
    num_engines: int = option(0, key="{role}", help="{role} engines")
    num_gpus_per_engine: float | None = option(
        None,
        key="{role}_num_gpus_per_engine",
        default_text="--num-gpus-per-engine",
        help="GPUs per {role} engine, a fraction shares a GPU",
    )
    ray_resources: dict[str, float] = option(
        default_factory=dict,
        key="{role}_ray_resources",
        metavar="JSON",
        help="Ray custom resources each {role} engine requests, e.g. '{{\"tandem_{role}\": 1}}'",
    )
    min_engines: int = option(
        1,
        key="{role}_min_engines",
        help="fewest {role} engines a resize (POST /admin/pools/{role}, tandem scale, "
        "the planner) may leave",
    )
    max_engines: int | None = option(
        None,
        key="{role}_max_engines",
        default_text="no limit (the planner needs one)",
        help="most {role} engines a resize may start",
    )
    engine: dict[str, Any] = option(
        default_factory=dict,
        key="{role}_engine",
        yaml_only=True,
        help="engine keys of the {role} pool only (flags: --{role}-X)",
    )

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"pool role must be one of {', '.join(ROLES)}, got {self.role!r}")
        key = f"{self.role}_ray_resources"
        object.__setattr__(self, "ray_resources", parse_ray_resources(self.ray_resources, key))
        if self.num_gpus_per_engine is not None:
            key = f"{self.role}_num_gpus_per_engine"
            object.__setattr__(
                self, "num_gpus_per_engine", check_num_gpus(self.num_gpus_per_engine, key)
            )
        if isinstance(self.num_engines, bool) or not isinstance(self.num_engines, int):
            raise ValueError(f"{self.role} must be an integer, got {self.num_engines!r}")
        self._check_bounds()
        from tandem.workers.config import engine_fields

        if not isinstance(self.engine, dict):
            raise ValueError(f"{self.role}_engine must be a mapping, got {self.engine!r}")
        bad = set(self.engine) - {leaf.key for leaf in engine_fields()}
        if bad:
            internal = bad & {leaf.key for leaf in engine_fields(internal=True)}
            why = f" ({', '.join(sorted(internal))}: set by tandem serve)" if internal else ""
            raise ValueError(f"--config: unknown keys in {self.role}_engine: {sorted(bad)}{why}")

    def _check_bounds(self) -> None:
        """min <= max, and a running pool starts inside them (ValueError naming the field)."""
        lo, hi, n = self.min_engines, self.max_engines, self.num_engines
        key = f"{self.role}_min_engines"
        if isinstance(lo, bool) or not isinstance(lo, int) or lo < 1:
            raise ValueError(
                f"{key} (--{key.replace('_', '-')}) must be an integer >= 1, got {lo!r}"
            )
        if hi is not None:
            key = f"{self.role}_max_engines"
            if isinstance(hi, bool) or not isinstance(hi, int) or hi < lo:
                raise ValueError(
                    f"{key} (--{key.replace('_', '-')}) must be an integer >= "
                    f"{self.role}_min_engines ({lo}), got {hi!r}"
                )
        if n and n < lo:
            raise ValueError(
                f"{self.role}_min_engines is {lo} but the {self.role} pool starts with {n} "
                f"(--{self.role})"
            )
        if n and hi is not None and n > hi:
            raise ValueError(
                f"{self.role}_max_engines is {hi} but the {self.role} pool starts with {n} "
                f"(--{self.role})"
            )

    def bounds_error(self, engines: int) -> str | None:
        """Why a resize to ``engines`` is refused (naming the field), or None."""
        if engines < self.min_engines:
            return (
                f"{engines} {self.role} engines is below {self.role}_min_engines "
                f"(--{self.role}-min-engines {self.min_engines})"
            )
        if self.max_engines is not None and engines > self.max_engines:
            return (
                f"{engines} {self.role} engines is above {self.role}_max_engines "
                f"(--{self.role}-max-engines {self.max_engines})"
            )
        return None


@dataclass(frozen=True)
class PoolsConfig:
    """The engine pools: prefill + decode (disaggregated) or colocated alone."""

    prefill: PoolConfig = option(
        default_factory=lambda: PoolConfig("prefill", 1), help="the prefill pool"
    )
    decode: PoolConfig = option(
        default_factory=lambda: PoolConfig("decode", 1), help="the decode pool"
    )
    colocated: PoolConfig = option(
        default_factory=lambda: PoolConfig("colocated", 0),
        help="the colocated pool (replaces prefill and decode)",
    )
    num_gpus_per_engine: float = option(
        0, help="GPUs per engine (0 = CPU; 0.5 = two engines share a GPU)"
    )
    scale_start_timeout_s: float = option(
        600.0,
        help="a resize waits this long for a new engine to be placed and ready (on KubeRay "
        "the autoscaler may first add a pod); past it the start is reported failed and "
        "the engine stopped",
    )
    scale_drain_timeout_s: float = option(
        120.0,
        help="a resize waits this long for a removed engine to finish its handoffs and "
        "move its streams before stopping it",
    )
    pool_moves: bool = option(
        True,
        help="an engine may move between the prefill and decode pools while serving "
        "(POST /admin/pools/move, tandem scale --move, the sla planner) where both pools' "
        "engines have the same settings and resources; their NIXL connectors then serve "
        "and read from the start (cluster/engines/pool_moves.py)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "num_gpus_per_engine",
            check_num_gpus(self.num_gpus_per_engine, "num_gpus_per_engine"),
        )
        for key in ("scale_start_timeout_s", "scale_drain_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} (--{key.replace('_', '-')}) must be > 0")
        for role in ROLES:
            if self.pool(role).role != role:
                raise ValueError(f"pools.{role} holds the {self.pool(role).role} pool")
        if self.colocated.num_engines:
            for role in ("prefill", "decode"):  # a colocated pool replaces them
                object.__setattr__(self, role, dataclasses.replace(self.pool(role), num_engines=0))
        elif self.prefill.num_engines < 0 or self.decode.num_engines < 1:
            raise ValueError("--decode must be >= 1 and --prefill >= 0 (or use --colocated K)")

    def pool(self, role: str) -> PoolConfig:
        return getattr(self, role)

    def sizes(self) -> dict[str, int]:
        return {role: self.pool(role).num_engines for role in ROLES}

    def reach(self) -> dict[str, int]:
        """The most engines each running pool may have (its max, else its
        size): the default router is chosen by it, so a pool that may grow
        past one engine routes kv-aware from the start."""
        out = {}
        for role, n in self.sizes().items():
            hi = self.pool(role).max_engines
            out[role] = max(n, hi) if n and hi is not None else n
        return out

    def placement(self, role: str) -> tuple[int | float, dict[str, float]]:
        """``(GPUs per engine, Ray resources per engine)`` of one pool."""
        pool = self.pool(role)
        num_gpus = pool.num_gpus_per_engine
        if num_gpus is None:
            num_gpus = self.num_gpus_per_engine
        return num_gpus, dict(pool.ray_resources)


def engine_actor_placement(
    num_gpus: int | float, resources: dict[str, float]
) -> tuple[dict[str, Any], dict[str, float] | None]:
    """``(Ray actor options, placement group bundle or None)`` of one engine.

    CPU engines ask Ray for nothing but their custom resources (they share
    the node's cores). GPU engines get a one-bundle STRICT_PACK group of
    ``num_gpus`` GPUs (fractions allowed: two 0.5 bundles fit one GPU and
    Ray hands both actors the same device), one CPU and the resources.
    """
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": num_gpus}
    if resources:
        options["resources"] = dict(resources)
    if not num_gpus:
        return options, None
    return options, {"GPU": num_gpus, "CPU": 1, **resources}


def check_pool_parallel(role: str, config: Any, num_gpus: float) -> None:
    """A pool's tensor-parallel size against its GPUs.

    Each rank holds its own bundle of the engine's STRICT_PACK group
    (``engine_group_placement``): ``num_gpus`` (when not 0, i.e. CPU) must be
    at least ``tensor_parallel_size`` and split into equal whole GPUs.
    ValueError names the fields.
    """
    tp = config.parallel.tensor_parallel_size
    if tp > 1 and num_gpus and num_gpus < tp:
        raise ValueError(
            f"{role}_num_gpus_per_engine ({num_gpus}) is less than the {role} engines' "
            f"tensor_parallel_size ({tp}): each worker needs its own GPU"
        )
    if tp > 1 and num_gpus:
        per_rank_gpus(num_gpus, tp, f"{role}_num_gpus_per_engine")


def check_pools_split_model(model_path: str, specs: list[Any]) -> None:
    """Every pool's ``tensor_parallel_size`` splits the model (heads, KV heads,
    MLP); ValueError naming the pool and the model field, before anything starts."""
    sizes = {s.role: s.config.parallel.tensor_parallel_size for s in specs}
    if all(n == 1 for n in sizes.values()):
        return
    from tandem.workers.checkpoints.hf_config import load_config
    from tandem.workers.parallel.plan import check_tensor_parallel

    config = load_config(model_path)
    for role, n in sizes.items():
        try:
            check_tensor_parallel(config, n)
        except ValueError as exc:
            raise ValueError(f"{role} pool: {exc}") from None


# ---- tensor parallelism: one bundle per rank (module doc) ----------------------------

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
