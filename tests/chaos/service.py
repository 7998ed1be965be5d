"""The chaos suite's service: a local Ray with the NIXL read-fault switch
wired in, one prefill and two decode engines, helpers to fault and inspect
them. Each test module starts its own (``chaos_service``)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

from tandem.cluster.cli.serve import ServiceThread
from tandem.kvtransfer.fault_injection import ENV_READ_FAIL_FILE
from tests.chaos.harness import WORKLOADS, Workload, serve_config
from tests.cluster.service_helpers import BUSY_FIELDS


@contextlib.contextmanager
def chaos_service(policy: str, **kw):
    """Yields ``(svc, switch_path, references)``: the running service, the
    file that arms the injected READ failure, and the undisturbed run's
    results per workload (taken before any fault)."""
    import ray

    switch_dir = tempfile.mkdtemp(prefix="tandem-chaos-")
    switch = os.path.join(switch_dir, "fail-reads")
    ray.init(
        include_dashboard=False,
        num_cpus=2,
        log_to_driver=False,
        runtime_env={"env_vars": {ENV_READ_FAIL_FILE: switch}},
    )
    namespace = f"chaos-{os.getpid()}-{policy}"
    try:
        with ServiceThread(serve_config(namespace, load_failure_policy=policy, **kw)) as svc:
            references = {}
            for workload in WORKLOADS:
                w = Workload(svc.base_url, workload)
                assert not any(w.finish())
                references[workload] = w.results
                for r in w.results:
                    assert r.done and r.error is None and r.finish_reason == "length", r
            yield svc, switch, references
    finally:
        ray.shutdown()
        with contextlib.suppress(OSError):
            os.remove(switch)
        os.rmdir(switch_dir)


def engine(svc, engine_id: str):
    return svc.service.backend.engines[engine_id]


def requests_on(svc, engine_id: str) -> set[str]:
    async def snapshot() -> set[str]:
        return set(engine(svc, engine_id).requests)

    return svc.run(snapshot())


def actor(svc, engine_id: str):
    import ray

    return ray.get_actor(engine_id, namespace=svc.service.config.ray.ray_namespace)


def wait_ready(svc, engine_id: str, deadline_s: float = 120.0, new_epoch_after: int = 0) -> None:
    end = time.monotonic() + deadline_s
    e = engine(svc, engine_id)
    while not (e.state.ready and e.state.epoch != new_epoch_after):
        assert time.monotonic() < end, f"{engine_id} not ready within {deadline_s} s"
        time.sleep(0.1)


def stats(handle):
    import ray

    from tandem.scheduler.engine_stats import STATS_DECODER

    return STATS_DECODER.decode(ray.get(handle.actor.stats.remote(), timeout=30))


def settle(svc, skip: tuple[str, ...] = (), deadline_s: float = 60.0) -> int:
    """Every engine but ``skip`` (dead for good) idle, then check_integrity();
    returns the KV blocks still held (in use or held for a transfer)."""
    return settle_engines([h for h in svc.service.handles if h.engine_id not in skip], deadline_s)


def settle_engines(handles, deadline_s: float = 60.0) -> int:
    """``settle`` for engine handles (``cluster.engines.pools.EngineHandle``) of any
    gateway, called over Ray from the test process."""
    import ray

    handles = {h.engine_id: h for h in handles}
    end = time.monotonic() + deadline_s
    while True:
        sched = {eid: stats(h).scheduler for eid, h in handles.items()}
        busy = {e: s for e, s in sched.items() if any(getattr(s, k) for k in BUSY_FIELDS)}
        if not busy:
            break
        assert time.monotonic() < end, f"engines not idle: {busy}"
        time.sleep(0.1)
    for eid, h in handles.items():
        assert ray.get(h.actor.check_integrity.remote(), timeout=30), eid
    num_blocks = {
        eid: ray.get(h.actor.ready.remote(), timeout=30)["num_kv_blocks"]
        for eid, h in handles.items()
    }
    return sum(
        round(s.kv_cache_usage * num_blocks[eid]) + s.num_blocks_held_for_transfer
        for eid, s in sched.items()
    )


def kv_read_failures(svc) -> float:
    """Failed KV loads counted by the decode engines (injected ones included)."""
    return sum(
        stats(h).kv_transfer.transfer_failures_total
        for h in svc.service.handles
        if h.role == "decode"
    )


def reset_prefix_caches(svc) -> None:
    """Forget cached prompts everywhere, so each scenario's requests go the
    whole way (P prefill + NIXL read) as on first sight: with prefix hits on
    a decode engine, kv-aware routing would skip P for a repeated prompt."""
    import ray

    refs = [h.actor.reset_prefix_cache.remote() for h in svc.service.handles]
    assert all(ray.get(refs, timeout=30))


def wait_restarted(handle, old_pid: int, deadline_s: float = 90.0) -> int:
    """Until Ray has the actor ``handle`` up again in a process other than
    ``old_pid`` (its ``ready()`` answers); returns the new pid. Fails if Ray
    reports it dead for good (restarts exhausted) or at the deadline."""
    import ray

    end = time.monotonic() + deadline_s
    while True:
        try:
            info = ray.get(handle.ready.remote(), timeout=10)
        except ray.exceptions.ActorUnavailableError:
            info = None  # restarting: Ray answers "temporarily unavailable"
        except ray.exceptions.GetTimeoutError:
            info = None  # its constructor is still running
        if info is not None and info["pid"] != old_pid:
            return info["pid"]
        assert time.monotonic() < end, f"actor not back within {deadline_s} s"
        time.sleep(0.1)


def wait_dead_for_good(handle, deadline_s: float = 60.0) -> None:
    """Until a call on ``handle`` fails with ``ActorDiedError`` (Ray gave up
    restarting it). Its name stays registered while the actor is DEAD (Ray
    2.60; seen still there 40 s later), so ``ray.get_actor`` still answers
    and only a call tells."""
    import ray

    end = time.monotonic() + deadline_s
    while True:
        try:
            ray.get(handle.ready.remote(), timeout=10)
        except ray.exceptions.ActorDiedError:
            return
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass  # still restarting (a kill that did not exhaust the budget)
        assert time.monotonic() < end, f"actor not dead for good within {deadline_s} s"
        time.sleep(0.1)
