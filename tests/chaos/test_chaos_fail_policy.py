"""Chaos, second service (load-failure policy ``fail``, ``max_restarts=4``):
injected NIXL READ failures end the requests they hit with an explicit error;
then a restart storm takes one decode engine out for good while the other
keeps serving. Same verdicts as tests/chaos/test_chaos_recompute.py."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.chaos.harness import NUM_STREAMS, WORKLOADS, Tally, Workload, print_row, verdict
from tests.chaos.service import (
    actor,
    chaos_service,
    engine,
    kv_read_failures,
    requests_on,
    reset_prefix_caches,
    settle,
    wait_dead_for_good,
    wait_ready,
    wait_restarted,
)
from tests.chaos.test_chaos_recompute import run

pytestmark = pytest.mark.slow

NUM_KILLS = 5


@pytest.fixture(scope="module")
def chaos():
    with chaos_service("fail", max_restarts=NUM_KILLS - 1) as svc_switch_refs:
        yield svc_switch_refs


def test_injected_nixl_read_failure_fail_policy_errors_explicitly(chaos):
    svc, switch, refs = chaos
    before = kv_read_failures(svc)
    open(switch, "w").close()
    try:
        tally, _, _ = run(svc, refs, "NIXL READ fails (policy fail)", lambda _: None, min_tokens=0)
    finally:
        os.remove(switch)
    assert kv_read_failures(svc) > before
    # every read failed: each request got P's token, then an explicit error
    assert tally.errored > 0 and tally.identical + tally.errored == tally.requests
    assert settle(svc) == 0


def test_restart_storm_exhausts_restarts_streams_migrate_pool_shrinks(chaos):
    """decode-0's process is SIGKILLed ``NUM_KILLS`` times, each time once Ray
    has it back up and the gateway serves it again. With ``max_restarts =
    NUM_KILLS - 1`` the last kill exhausts the budget: decode-0 stays dead,
    the streams on it move to decode-1 (or, past --max-migrations, end with an
    explicit error), /health says degraded but 200, and new requests are
    served by decode-1 alone. Runs last: the service keeps one decode engine.

    Wave 1 runs through the first kills. Wave 2 is placed on decode-0 alone
    (decode-1 drained while it is admitted, then undrained) so that the final
    kill certainly has streams to move, and only decode-1 can take them."""
    svc, _, refs = chaos
    backend = svc.service.backend
    assert svc.service.config.ray.max_restarts == NUM_KILLS - 1
    tally = Tally("restart storm (decode-0 killed 5x, restarts exhausted)")
    handle = actor(svc, "decode-0")
    before = sum(backend.migrator.num_migrations.values())
    reset_prefix_caches(svc)
    wave1 = [Workload(svc.base_url, w) for w in WORKLOADS]
    for w in wave1:
        w.wait_tokens(4)
    moved = requests_on(svc, "decode-0")
    start_s = time.monotonic()
    back_s: list[float] = []  # when each restarted incarnation was served again
    pid = engine(svc, "decode-0").state.info["pid"]
    for _ in range(NUM_KILLS - 1):
        epoch = engine(svc, "decode-0").state.epoch
        os.kill(pid, signal.SIGKILL)  # a crash: counts against max_restarts
        pid = wait_restarted(handle, pid)
        wait_ready(svc, "decode-0", new_epoch_after=epoch)  # the gateway serves it again
        back_s.append(round(time.monotonic() - start_s, 1))
    assert engine(svc, "decode-0").num_restarts == NUM_KILLS - 1
    for w in wave1:  # before the drain below (it would move wave 1's streams)
        tally.add(w.workload, w.results, refs[w.workload], w.finish(), start_s, moved)
    # wave 2 on decode-0 alone: decode-1 takes no new work while it is admitted
    svc.run(backend.drain("decode-1", timeout_s=30.0), timeout_s=60.0)
    try:
        wave2 = [Workload(svc.base_url, w) for w in WORKLOADS]
        for w in wave2:
            w.wait_tokens(4)
        on_d0 = requests_on(svc, "decode-0")
    finally:
        backend.undrain("decode-1")  # a flag: ready again at the next health check
    assert on_d0, "wave 2 is not on decode-0"
    migrated = sum(backend.migrator.num_migrations.values())
    final_s = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # the last kill: no restart left
    storm_s = final_s - start_s
    wait_dead_for_good(handle)
    for w in wave2:
        tally.add(w.workload, w.results, refs[w.workload], w.finish(), final_s, on_d0)
    assert tally.hung == 0 and tally.wrong == 0, tally.details
    # its streams moved to decode-1 (those not finished by the kill)
    moved_last = sum(backend.migrator.num_migrations.values()) - migrated
    assert moved_last > 0
    # the pool shrank: decode-0 is out for good, the gateway says degraded
    assert not engine(svc, "decode-0").state.ready
    assert [st.engine_id for st in backend.router.ready_engines("decode")] == ["decode-1"]
    health = httpx.get(svc.base_url + "/health", timeout=10)
    assert health.status_code == 200, health.text
    assert health.json()["status"] == "degraded" and "decode-0" in health.json()["reason"]
    # and serves: a fresh wave, all on decode-1, all identical
    after = [Workload(svc.base_url, w) for w in WORKLOADS]
    for w in after:
        tally.add(w.workload, w.results, refs[w.workload], w.finish())
    tally.leaked_blocks = settle(svc, skip=("decode-0",))
    print_row(tally)
    print(
        f"   storm: {NUM_KILLS} kills in {storm_s:.1f} s (served again at {back_s} s), "
        f"{sum(backend.migrator.num_migrations.values()) - before} migrations, {moved_last} of "
        f"{len(on_d0)} streams on decode-0 at the last kill",
        flush=True,
    )
    assert tally.hung == 0 and tally.wrong == 0, tally.details
    assert tally.identical + tally.errored == tally.requests
    # wave 2 could only go to decode-1 (one migration at most): identical
    assert all(
        verdict(r, ref, False) == "identical"
        for w in wave2
        for r, ref in zip(w.results, refs[w.workload], strict=True)
    ), tally.details
    assert tally.identical >= 4 * NUM_STREAMS  # waves 2 and 3 whole
    assert tally.leaked_blocks == 0
