"""Engine pools: one Ray actor per engine, per-pool configuration.

    --prefill N --decode M    ->  prefill-0..N-1, decode-0..M-1   (NIXL connector on)
    --colocated K             ->  colocated-0..K-1                (no connector)

On GPU clusters each engine gets ``num_gpus`` GPUs in its own STRICT_PACK
placement group; on CPU the actors ask for no CPU or GPU (they share the
node's cores; ``torch_threads`` splits them). ``resources`` (custom Ray
resources, ``cluster.placement``) pins a pool to the nodes that advertise them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from workers.config import EngineConfig


@dataclass
class PoolSpec:
    role: str  # prefill | decode | colocated
    num_engines: int
    config: EngineConfig
    num_gpus: int = 0
    max_restarts: int = 3
    # Ray custom resources per engine (cluster.placement): pins a pool to
    # the nodes that advertise them.
    resources: dict[str, float] = field(default_factory=dict)


@dataclass
class EngineHandle:
    engine_id: str
    role: str
    actor: object  # ray.actor.ActorHandle
    placement_group: object | None = None


def default_torch_threads(num_engines: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(num_engines, 1))


def start_pools(specs: list[PoolSpec], output_addr: str) -> list[EngineHandle]:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.engine_actor import EngineActor

    remote_cls = ray.remote(EngineActor)
    total = sum(s.num_engines for s in specs)
    threads = default_torch_threads(total)
    handles = []
    for spec in specs:
        for i in range(spec.num_engines):
            engine_id = f"{spec.role}-{i}"
            cfg = spec.config.replace(engine_id=engine_id, role=spec.role)
            if not spec.num_gpus and not cfg.torch_threads:
                cfg = cfg.replace(torch_threads=threads)
            options: dict = {
                "max_restarts": spec.max_restarts,
                "max_task_retries": 0,
                "num_cpus": 0,
                "num_gpus": spec.num_gpus,
                "max_concurrency": 4,  # control calls run beside a slow one
            }
            if spec.resources:
                options["resources"] = dict(spec.resources)
            pg = None
            if spec.num_gpus > 0:
                bundle = {"GPU": spec.num_gpus, "CPU": 1, **spec.resources}
                pg = placement_group([bundle], strategy="STRICT_PACK")
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg)
                cfg = cfg.replace(device="cuda")
            actor = remote_cls.options(**options).remote(cfg, output_addr)
            handles.append(EngineHandle(engine_id, spec.role, actor, pg))
    return handles


def stop_pools(handles: list[EngineHandle], timeout_s: float = 10.0) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    refs = []
    for h in handles:
        try:
            refs.append(h.actor.shutdown.remote())
        except Exception:  # noqa: BLE001 - already dead
            pass
    if refs:
        try:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        except Exception:  # noqa: BLE001
            pass
    for h in handles:
        try:
            ray.kill(h.actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        if h.placement_group is not None:
            remove_placement_group(h.placement_group)
