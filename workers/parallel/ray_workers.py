"""Tensor-parallel workers as Ray actors (an engine served by ``tandem serve``).

When the engine core runs inside a Ray actor, ranks 1..N-1 are Ray actors
too, running the same worker loop (``workers.parallel.worker.run_worker``)
as the local processes of ``tandem generate``: ZMQ steps, the gloo/NCCL
group and the KV connector are unchanged. Where each rank runs::

    engine placement group (STRICT_PACK, cluster/engines/placement.py)
    bundle 0: engine actor (scheduler + rank 0)   bundle r: rank r's worker actor

    no placement group, CPU engine (a detached actor): plain actors that
    ask for no CPU, pinned to the engine actor's node

A GPU engine without a placement group (a detached actor holding all its
GPUs itself) keeps local worker processes: ``ray_launcher`` returns None.

Failure: each worker runs one long method (``run``) whose reference only
resolves when the worker ends; the executor's liveness check polls it
(``exitcode``), so a killed or crashed worker actor fails the engine as
one unit (``WorkerFailed``: the engine actor exits and Ray restarts it with
a new epoch, which starts fresh worker actors). The worker actors are owned
by the engine actor: Ray kills them when it dies, so none outlive it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from tandem.workers.parallel.messages import WorkerSpec

logger = logging.getLogger(__name__)

DESCRIBE_TIMEOUT_S = 60.0
ACTOR_PREFIX = "tp-worker"


class TPWorkerActor:
    """One rank 1..N-1 (``ray.remote`` wraps it). ``describe`` runs before
    ``run`` (an actor runs its calls in order), ``run`` until the worker ends."""

    def describe(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "actor_id": ctx.get_actor_id(),
            "placement_group_id": ctx.get_placement_group_id(),
        }

    def run(self, spec: WorkerSpec) -> None:
        from tandem.workers.parallel.worker import run_worker

        run_worker(spec)  # ends the process (os._exit) when the worker stops


class RayWorkerHandle:
    """A worker actor seen through the part of ``multiprocessing.Process``
    the executor uses: ``pid``, ``exitcode``, ``join``, ``terminate``, ``kill``."""

    def __init__(
        self, actor: Any, name: str, namespace: str, spec: WorkerSpec, bundle_index: int
    ) -> None:
        self.actor = actor
        self.bundle_index = bundle_index  # -1: no placement group
        self.name = name
        self.namespace = namespace
        self._info_ref = actor.describe.remote()
        self._run_ref = actor.run.remote(spec)
        self._info: dict[str, Any] | None = None
        self._exitcode: int | None = None

    def describe(self) -> dict[str, Any]:
        """Where the actor runs (pid, node, actor id, placement group id),
        the bundle it was asked into, and its Ray name and namespace; an
        actor that died before answering: ``pid`` None and ``error``."""
        import ray

        mine = {"bundle_index": self.bundle_index, "name": self.name, "namespace": self.namespace}
        if self._info is None:
            try:
                self._info = ray.get(self._info_ref, timeout=DESCRIBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - died first: the engine fails soon
                return {**mine, "pid": None, "error": f"{type(exc).__name__}: {exc}"}
        return {**self._info, **mine}

    @property
    def pid(self) -> int | None:
        return self.describe()["pid"]

    @property
    def exitcode(self) -> int | None:
        """None while ``run`` is outstanding; 0 when it returned, 1 when the
        actor died (killed, crashed, or exited after its last reply)."""
        if self._exitcode is None:
            self.join(0.0)
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        import ray

        if self._exitcode is not None:
            return
        done, _ = ray.wait([self._run_ref], timeout=timeout)
        if not done:
            return
        try:
            ray.get(self._run_ref)
            self._exitcode = 0
        except Exception:  # noqa: BLE001 - RayActorError / ActorDiedError
            self._exitcode = 1

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


class RayLauncher:
    """Starts rank ``r`` as a worker actor, in bundle ``r`` of ``pg`` when
    there is one, else on ``node_id`` asking for no CPU."""

    def __init__(self, pg: Any, node_id: str, name_prefix: str, namespace: str) -> None:
        import ray

        self.pg = pg
        self.node_id = node_id
        self.name_prefix = name_prefix
        self.namespace = namespace
        self._cls = ray.remote(TPWorkerActor)

    def start(self, spec: WorkerSpec) -> RayWorkerHandle:
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        name = f"{self.name_prefix}-rank{spec.rank}"
        options: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        if self.pg is not None:
            bundle = self.pg.bundle_specs[spec.rank]
            options.update(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg,
                    placement_group_bundle_index=spec.rank,
                    placement_group_capture_child_tasks=False,
                ),
            )
            if bundle.get("GPU", 0):  # Ray shows the actor only its own GPU(s)
                spec.device_index = 0
        else:
            options.update(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
            )
        actor = self._cls.options(**options).remote()
        bundle_index = spec.rank if self.pg is not None else -1
        return RayWorkerHandle(actor, name, self.namespace, spec, bundle_index)


def ray_launcher(config: Any, tp_size: int) -> RayLauncher | None:
    """A ``RayLauncher`` when this process is a Ray actor whose workers can
    be actors (see the module doc), else None (local processes)."""
    if "ray" not in sys.modules:  # tandem generate never imports Ray
        return None
    import ray

    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id() is None:  # a driver (tests, LLM beside Ray): processes
        return None
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    if pg is not None and len(pg.bundle_specs) < tp_size:
        pg = None  # a one-bundle group from before: the actor holds every GPU
    if pg is None and config.model.device != "cpu":
        return None
    prefix = f"{ACTOR_PREFIX}-{config.runtime.engine_id}-{config.runtime.epoch}"
    return RayLauncher(pg, ctx.get_node_id(), prefix, ctx.namespace)
