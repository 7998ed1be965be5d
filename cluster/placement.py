"""Where a pool's engines may run: per-pool Ray resources and GPU counts.

On a cluster whose nodes are split into groups (KubeRay worker groups
``prefill`` and ``decode``), each group advertises a custom Ray resource
(``ray start --resources '{"tandem_prefill": 2}'``) and every engine of a pool
asks for one unit of it, so Ray places prefill engines only on prefill nodes::

    tandem serve --prefill 4 --prefill-ray-resources '{"tandem_prefill": 1}' \\
                 --decode 4  --decode-ray-resources  '{"tandem_decode": 1}'

``--<pool>-num-gpus-per-engine`` overrides ``--num-gpus-per-engine`` for one
pool (prefill engines with 2 GPUs, decode engines with 1).
"""

from __future__ import annotations

import json
import math
from typing import Any

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
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: not valid JSON ({exc.msg}): {value!r}") from None
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


def resolve_placement(settings: dict[str, Any]) -> None:
    """Normalise the per-pool placement settings in place (see module doc)."""
    for role in ROLES:
        key = f"{role}_ray_resources"
        settings[key] = parse_ray_resources(settings.get(key), key)
        gpus_key = f"{role}_num_gpus_per_engine"
        if settings.get(gpus_key) is None:
            settings[gpus_key] = settings["num_gpus_per_engine"]
    for key in ("num_gpus_per_engine", *(f"{r}_num_gpus_per_engine" for r in ROLES)):
        value = settings[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key} must be an integer >= 0, got {value!r}")


def pool_placement(settings: dict[str, Any], role: str) -> tuple[int, dict[str, float]]:
    """``(GPUs per engine, Ray resources per engine)`` of one pool, from
    resolved settings or from a plain settings dict (tests, benchmarks)
    that leaves the per-pool keys unset."""
    num_gpus = settings.get(f"{role}_num_gpus_per_engine")
    if num_gpus is None:
        num_gpus = settings.get("num_gpus_per_engine") or 0
    key = f"{role}_ray_resources"
    return num_gpus, parse_ray_resources(settings.get(key), key)


def add_placement_arguments(parser: Any) -> None:
    for role in ROLES:
        parser.add_argument(
            f"--{role}-ray-resources",
            metavar="JSON",
            help=f"Ray custom resources each {role} engine requests, e.g. "
            f"'{{\"tandem_{role}\": 1}}'",
        )
        parser.add_argument(
            f"--{role}-num-gpus-per-engine",
            type=int,
            help=f"GPUs per {role} engine (default: --num-gpus-per-engine)",
        )
