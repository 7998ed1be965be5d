"""Chaos against a real service (1 prefill + 2 decode engines, local Ray, tiny
model, load-failure policy ``recompute``). Every scenario runs a greedy and a
seeded workload of 16 concurrent streams each, at once, and checks every
request against the undisturbed run (tests/chaos/harness.py); afterwards
every engine is idle, passes check_integrity() and holds no block."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.chaos.harness import WORKLOADS, Tally, Workload, print_row
from tests.chaos.service import (
    chaos_service,
    engine,
    kv_read_failures,
    requests_on,
    reset_prefix_caches,
    settle,
    wait_ready,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chaos():
    with chaos_service("recompute") as svc_switch_refs:
        yield svc_switch_refs


def run(svc, refs, name: str, fault, on_busiest_decode: bool = False, min_tokens: int = 4):
    """Both workloads at once; ``fault(engine_id)`` once every stream has
    ``min_tokens`` tokens, with the decode engine holding most streams then
    (``on_busiest_decode``; the router may put them all on one) or None.
    Returns the tally (hung and wrong asserted 0) and the ids that were on it."""
    tally = Tally(name)
    reset_prefix_caches(svc)
    loads = [Workload(svc.base_url, w) for w in WORKLOADS]
    for w in loads:
        w.wait_tokens(min_tokens)
    target, moved = None, set()
    if on_busiest_decode:
        held = {eid: requests_on(svc, eid) for eid in ("decode-0", "decode-1")}
        target = max(held, key=lambda eid: len(held[eid]))
        moved = held[target]
    fault_s = time.monotonic()
    fault(target)
    for w in loads:
        tally.add(w.workload, w.results, refs[w.workload], w.finish(), fault_s, moved)
    print_row(tally)
    assert tally.hung == 0 and tally.wrong == 0, tally.details
    return tally, moved, target


def kill_actor_process(svc, engine_id: str) -> None:
    """SIGKILL the engine actor's process: dead when this returns, so the
    streams on it cannot finish there. (``ray.kill`` goes through the GCS and
    lands when the worker handles it: on a loaded CI box that was after all
    48 tokens of every stream, and nothing moved. tests/cluster/test_service.py
    covers ``ray.kill``.) Ray restarts the actor (max_restarts)."""
    os.kill(engine(svc, engine_id).state.info["pid"], signal.SIGKILL)


def test_kill_decode_actor_mid_stream_every_stream_identical(chaos):
    svc, _, refs = chaos
    backend = svc.service.backend
    before = sum(backend.migrator.num_migrations.values())
    epochs = {eid: engine(svc, eid).state.epoch for eid in ("decode-0", "decode-1")}
    killed = []

    def fault(eid: str) -> None:
        killed.append(eid)
        kill_actor_process(svc, eid)

    try:
        tally, moved, target = run(
            svc, refs, "kill decode actor mid-stream", fault, on_busiest_decode=True
        )
        assert moved, f"no stream was on {target} when it was killed"
        assert tally.identical == tally.requests, tally.details
        assert sum(backend.migrator.num_migrations.values()) - before == len(moved)
        assert len(tally.migration_s) == len(moved)
    finally:  # the next scenario needs the restarted engine, whatever failed here
        for eid in killed:
            wait_ready(svc, eid, new_epoch_after=epochs[eid])
    assert settle(svc) == 0


def test_kill_prefill_actor_during_kv_read(chaos):
    """P is killed as the first first-token comes back: the other requests are
    being prefilled or read by D. Reads from the dead P fail (D recomputes:
    policy recompute), prefills in flight go to D; nothing hangs or is wrong."""
    svc, _, refs = chaos
    epoch = engine(svc, "prefill-0").state.epoch
    try:
        tally, _, _ = run(
            svc,
            refs,
            "kill prefill actor during KV read",
            lambda _: kill_actor_process(svc, "prefill-0"),
            min_tokens=0,
        )
        assert tally.identical + tally.errored == tally.requests
    finally:
        wait_ready(svc, "prefill-0", new_epoch_after=epoch)
    assert settle(svc) == 0


def test_injected_nixl_read_failure_recompute_policy(chaos):
    svc, switch, refs = chaos
    before = kv_read_failures(svc)
    open(switch, "w").close()
    try:
        tally, _, _ = run(svc, refs, "NIXL READ fails (policy recompute)", lambda _: None)
    finally:
        os.remove(switch)
    assert kv_read_failures(svc) > before
    assert tally.identical == tally.requests, tally.details
    assert settle(svc) == 0


def test_sigstop_decode_engine_2s_is_slow_not_dead(chaos):
    svc, _, refs = chaos
    backend = svc.service.backend
    before = dict(backend.migrator.num_migrations)
    pid = engine(svc, "decode-1").state.info["pid"]

    def pause(_) -> None:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(2.0)
        finally:
            os.kill(pid, signal.SIGCONT)

    tally, _, _ = run(svc, refs, "SIGSTOP decode engine 2 s", pause)
    assert tally.identical == tally.requests, tally.details
    assert backend.migrator.num_migrations == before  # slow is not dead: nothing moved
    assert engine(svc, "decode-1").state.ready
    assert settle(svc) == 0
