"""Engine pools: one Ray actor per engine, per-pool configuration.

    --prefill N --decode M    ->  prefill-0..N-1, decode-0..M-1   (NIXL connector on)
    --colocated K             ->  colocated-0..K-1                (no connector)

Each engine is a *named* Ray actor in the namespace ``--ray-namespace``
(default ``tandem``), so operators find it with
``ray.get_actor("decode-0", namespace="tandem")``. Two services on one Ray
cluster need different namespaces: a taken name fails ``start_pools`` before
any actor starts, with an error naming the flag.

On GPU clusters each engine gets ``num_gpus`` GPUs (a fraction shares one)
in its own STRICT_PACK placement group, one bundle per tensor-parallel rank
(``cluster.engines.placement``: rank r's worker actor runs in bundle r; CPU
engines with TP > 1 get CPU bundles); on CPU the actors ask for no CPU or
GPU (they share the node's cores; ``torch_threads`` splits them). ``resources`` (custom Ray
resources, ``cluster.engines.placement``) pins a pool to the nodes that advertise them.

``detached``: the actors get Ray's ``lifetime="detached"`` and outlive the
gateway that started them (``--detach-engines``; a later gateway adopts them
with ``--attach``, ``cluster/engines/attach.py``). They ask for their GPUs on the
actor itself, without a placement group (one would be owned by, and die
with, the gateway).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from tandem.cluster.engines.placement import engine_group_placement
from tandem.wire.config_fields import option
from tandem.workers.config import EngineConfig


@dataclass
class PoolSpec:
    role: str  # prefill | decode | colocated
    num_engines: int
    config: EngineConfig
    num_gpus: int | float = 0  # a fraction in (0, 1) shares a GPU (cluster.engines.placement)
    max_restarts: int = 3
    # Ray custom resources per engine (cluster.engines.placement): pins a pool to
    # the nodes that advertise them.
    resources: dict[str, float] = field(default_factory=dict)
    # the model's config as plain attributes (workers.checkpoints.hf_config.plain_config),
    # read once by the gateway and handed to every engine it starts; None: each reads its own
    model_config: dict | None = None


@dataclass
class EngineHandle:
    engine_id: str
    role: str
    actor: object  # ray.actor.ActorHandle
    placement_group: object | None = None
    namespace: str | None = None  # the Ray namespace of the actor's name


def default_torch_threads(num_engines: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(num_engines, 1))


DEFAULT_NAMESPACE = "tandem"


@dataclass(frozen=True)
class RayConfig:
    """The Ray cluster and the engine actors' lifetime: a section of the serve
    configuration (``--detach-engines`` / ``--attach``: cluster/engines/attach.py)."""

    address: str | None = option(None, default_text="start a local Ray", help="Ray address to join")
    ray_namespace: str = option(
        DEFAULT_NAMESPACE,
        help="Ray namespace of the named engine actors prefill-<i>/decode-<i>/colocated-<i> "
        "(give each service on one Ray cluster its own)",
    )
    max_restarts: int = option(3, help="Ray restarts per engine actor")
    ray_dashboard: bool = option(
        True, help="the local Ray that tandem serve starts runs its dashboard"
    )
    detach_engines: bool = option(
        False,
        help="start the engines as detached Ray actors that outlive this gateway "
        "(needs --address and --cluster-secret-file; stop them with tandem stop-engines)",
    )
    attach: bool = option(
        False,
        help="adopt the engines running in --ray-namespace (left by --detach-engines) "
        "instead of starting new ones; same --model and --cluster-secret-file",
    )

    def __post_init__(self) -> None:
        if not self.ray_namespace:
            object.__setattr__(self, "ray_namespace", DEFAULT_NAMESPACE)
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1 (-1 = always), got {self.max_restarts}")
        if self.detach_engines and self.attach:
            raise ValueError(
                "--attach adopts running engines, --detach-engines starts new ones: pass one"
            )


def check_names_free(specs: list[PoolSpec], namespace: str) -> None:
    """ValueError if any engine name of ``specs`` is a live actor in ``namespace``."""
    import ray

    for spec in specs:
        for i in range(spec.num_engines):
            name = f"{spec.role}-{i}"
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                continue  # free
            raise ValueError(
                f"a Ray actor named {name!r} already exists in namespace {namespace!r} "
                "(another tandem serve on this Ray cluster?); pass --ray-namespace NAME "
                "to run beside it, or --attach to adopt engines left running by "
                "--detach-engines"
            )


def start_pools(
    specs: list[PoolSpec],
    output_addr: str,
    namespace: str = DEFAULT_NAMESPACE,
    gateway_session: int = 0,
    detached: bool = False,
) -> list[EngineHandle]:
    """Start every engine actor, named ``<role>-<i>`` in ``namespace``, served
    by the gateway whose session is ``gateway_session``."""
    check_names_free(specs, namespace)
    # one process per tensor-parallel rank shares the cores like an engine
    total = sum(s.num_engines * s.config.parallel.tensor_parallel_size for s in specs)
    threads = default_torch_threads(total)
    return [
        start_engine(spec, i, output_addr, namespace, gateway_session, detached, threads)
        for spec in specs
        for i in range(spec.num_engines)
    ]


def start_engine(
    spec: PoolSpec,
    index: int,
    output_addr: str,
    namespace: str = DEFAULT_NAMESPACE,
    gateway_session: int = 0,
    detached: bool = False,
    torch_threads: int = 1,
) -> EngineHandle:
    """One engine actor of ``spec``'s pool, ``<role>-<index>``: at start, and
    when a pool grows while serving (``cluster/disagg/scaling.py``). Returns
    at once; the actor is placed and constructed by Ray (its ``ready()``
    answers when it is up)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tandem.cluster.engines.actor import EngineActor

    engine_id = f"{spec.role}-{index}"
    cfg = spec.config.replace(engine_id=engine_id, role=spec.role)
    if not spec.num_gpus and not cfg.parallel.torch_threads:
        cfg = cfg.replace(torch_threads=torch_threads)
    tp = cfg.parallel.tensor_parallel_size
    options, bundles = engine_group_placement(spec.num_gpus, spec.resources, tp)
    options.update(
        name=engine_id,
        namespace=namespace,
        max_restarts=spec.max_restarts,
        max_task_retries=0,
        max_concurrency=4,  # control calls run beside a slow one
    )
    if detached:
        options["lifetime"] = "detached"
    pg = None
    if spec.num_gpus and detached:  # every GPU on the actor itself
        options["num_gpus"] = spec.num_gpus
        cfg = cfg.replace(device="cuda")
    elif bundles is not None and not detached:  # one bundle per TP rank
        pg = placement_group(bundles, strategy="STRICT_PACK")
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0
        )
        if spec.num_gpus:
            cfg = cfg.replace(device="cuda")
    actor = (
        ray.remote(EngineActor)
        .options(**options)
        .remote(cfg, output_addr, gateway_session, spec.model_config)
    )
    return EngineHandle(engine_id, spec.role, actor, pg, namespace)


def name_taken(name: str, namespace: str) -> bool:
    """A live (or not yet released) Ray actor holds ``name`` in ``namespace``."""
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


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
    _wait_names_released(handles, timeout_s)


def _wait_names_released(handles: list[EngineHandle], timeout_s: float) -> None:
    """Ray frees a killed actor's name asynchronously: wait (bounded) so that
    a service started next in the same namespace finds its names free."""
    import ray

    deadline = time.monotonic() + timeout_s
    for h in handles:
        namespace = getattr(h, "namespace", None)
        if namespace is None:
            continue
        while time.monotonic() < deadline:
            try:
                ray.get_actor(h.engine_id, namespace=namespace)
            except ValueError:
                break
            time.sleep(0.05)
