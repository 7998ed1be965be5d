"""One plain local Ray per test process, shared by the modules marked ``shared_ray``.

Starting a local Ray (GCS, raylet, agents, two prestarted workers) costs about 4.5 CPU-seconds
and stopping it 1.5 s of wall time; the suite's service modules each started and stopped one
on a machine of two cores. ``start()`` (or ``local_ray()``) starts it on first use in this test
process and leaves it up for the next module. ``tests/conftest.py`` stops it before any unmarked
module that may start Ray, a service or a gateway process of its own (those find no Ray
running, as alone) and at the end of the session; modules that never touch Ray run beside it
(idle, it costs about 0.04 CPU-seconds a second).

Isolation between the modules that share it: every service stops its engines on exit; if any
named actor or placement group is still alive at ``release()`` (a test that failed half-way),
the shared Ray is stopped, so the next module starts on a fresh one and never meets a taken
engine name or a bundle that holds the CPUs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

PLAIN = {"include_dashboard": False, "num_cpus": 2, "log_to_driver": False}
_state = {"shared": False}


def start() -> None:
    """A plain local Ray is up: the shared one (started now if it is not)."""
    import ray

    if not (_state["shared"] and ray.is_initialized()):
        if ray.is_initialized():  # someone else's: not ours to reuse
            ray.shutdown()
        ray.init(**PLAIN)
        _state["shared"] = True


def release() -> None:
    """The caller is done with it: left up for the next module, unless an actor outlived
    its service (then stopped, so the next one starts clean)."""
    import ray

    if ray.is_initialized() and _state["shared"] and not _no_actor_left(deadline_s=10.0):
        stop()


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    start()
    try:
        yield
    finally:
        release()


def _no_actor_left(deadline_s: float) -> bool:
    """No named actor alive in any namespace and no placement group holding resources
    (killed and removed ones leave the tables within the deadline)."""
    import ray
    from ray.util import placement_group_table

    def clean() -> bool:
        if ray.util.list_named_actors(all_namespaces=True):
            return False
        return all(pg["state"] == "REMOVED" for pg in placement_group_table().values())

    end = time.monotonic() + deadline_s
    while not clean():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def stop() -> None:
    """Stop the shared Ray if it is up (conftest: before unmarked modules, at session end)."""
    if not _state["shared"]:
        return
    import ray

    _state["shared"] = False
    if ray.is_initialized():
        ray.shutdown()
