"""Pool moves on the real service (cluster/disagg/pool_move.py): local Ray, the
tiny model, 1 prefill + 2 decode engines at start, moves on (alike pools).

- 1P2D -> 2P1D by moving a decode engine while 8 seeded streams run: every
  stream identical to the undisturbed run; the moved engine then serves
  prefill (its counters under the prefill role grow); /cluster/state, the
  scaling log and metrics show it; then back to 1P2D the same way, streams
  running again; every engine idle with check_integrity(), no block held.
- refusals: the busy engine refuses set_role (naming role); a pool's last
  engine, an unknown pool or engine, the same pool: 400 naming the field;
  the pools stay as they were.
- a moved engine that Ray restarts (its constructor's role is its first
  pool's) is switched back to its new pool before it registers.
- failures roll back: a refused switch leaves the engine undrained in its
  pool; a registration that does not finish puts it back in the old pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests import shared_ray
from tests.chaos.harness import Workload, serve_config, verdict
from tests.chaos.service import requests_on, reset_prefix_caches, settle, stats
from tests.cluster.test_scaling import cluster_state, ids, metric

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

KEY = "pool-move-test-admin-key"
NUM_STREAMS = 8
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def svc_refs():
    from tandem.cluster.cli.serve import ServiceThread

    shared_ray.start()
    config = serve_config(
        f"pool-move-{os.getpid()}",
        admin_api_key=KEY,
        prefill=1,
        decode=2,
        prefill_max_engines=2,
        decode_max_engines=2,
    )
    try:
        with ServiceThread(config) as svc:
            refs = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
            assert not any(refs.finish())
            for r in refs.results:
                assert r.done and r.error is None and r.finish_reason == "length", r
            yield svc, refs.results
    finally:
        shared_ray.release()


def move(svc, source_pool: str, dest_pool: str, key: str = KEY, **extra) -> httpx.Response:
    return httpx.post(
        f"{svc.base_url}/admin/pools/move",
        json={"source_pool": source_pool, "dest_pool": dest_pool, **extra},
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )


def busiest(svc, pool: str) -> str:
    """The engine of ``pool`` holding the most streams (the router may put them all on one)."""

    async def held() -> dict[str, int]:
        engines = svc.service.backend.engines.values()
        return {e.state.engine_id: len(e.requests) for e in engines if e.state.role == pool}

    counts = svc.run(held())
    return max(sorted(counts), key=counts.get)


def moved_under_load(svc, refs, source_pool: str, dest_pool: str) -> dict:
    """Move the busiest engine of ``source_pool`` while NUM_STREAMS streams run
    (a decode engine's streams migrate); every stream identical."""
    reset_prefix_caches(svc)
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    w.wait_tokens(4)
    r = move(svc, source_pool, dest_pool, engine_id=busiest(svc, source_pool))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["moved"] and body["error"] is None, body
    if source_pool == "decode":
        assert body["migrated"] >= 1, body
    assert body["drain_s"] >= 0 and body["switch_s"] >= 0 and body["register_s"] >= 0, body
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS, [r for r in w.results if r.error]
    return body


def assert_registered_as(svc, engine_id: str, role: str) -> None:
    """The gateway's record, the engine's own word, the index and the handle agree."""
    import ray

    backend = svc.service.backend
    e = backend.engines[engine_id]
    assert (e.state.role, e.handle.role, e.state.ready) == (role, role, True)
    assert ray.get(e.handle.actor.ready.remote(), timeout=30)["role"] == role
    assert stats(e.handle).role == role
    index = backend.routing.index
    if index is not None:
        assert index.engines[engine_id].role == role
        index.check_integrity()


def test_decode_engine_moves_to_prefill_under_load_and_back(svc_refs):
    svc, refs = svc_refs
    assert cluster_state(svc)["pool_moves"] == {"enabled": True, "reason": ""}
    body = moved_under_load(svc, refs, "decode", "prefill")
    moved = body["engine_id"]
    assert moved in {"decode-0", "decode-1"}, body
    assert ids(svc, "prefill") == {"prefill-0", moved}
    assert ids(svc, "decode") == {"decode-0", "decode-1"} - {moved}
    assert_registered_as(svc, moved, "prefill")
    pools = {p["role"]: (p["engines"], p["ready"]) for p in cluster_state(svc)["pools"]}
    assert pools == {"prefill": (2, 2), "decode": (1, 1)}, pools
    assert metric(svc, "tandem:pool_engines", pool="prefill") == 2
    assert metric(svc, "tandem:scaling_actions_total", pool="prefill", action="move",
                  outcome="ok") == 1  # fmt: skip
    events = cluster_state(svc)["scaling"]
    assert any(
        (e["pool"], e["action"], e["outcome"], e["engine_id"]) == ("prefill", "move", "ok", moved)
        and e["detail"] == "decode -> prefill"
        for e in events
    ), events

    # it serves prefill now: its prompt tokens grow under the prefill role
    handle = svc.service.backend.engines[moved].handle
    before = stats(handle).scheduler.num_prompt_tokens
    deadline = time.monotonic() + 120
    while stats(handle).scheduler.num_prompt_tokens == before:
        assert time.monotonic() < deadline, "the moved engine took no prefill"
        reset_prefix_caches(svc)
        more = Workload(svc.base_url, "greedy", NUM_STREAMS, max_tokens=4)
        assert not any(more.finish()) and all(r.error is None for r in more.results)
    assert svc.service.backend.engines[moved].state.role == "prefill"
    labels = {"engine": moved, "role": "prefill"}
    deadline = time.monotonic() + 30  # the gateway's stats refresh with its health probe
    while metric(svc, "tandem:prompt_tokens_computed_total", **labels) <= before:
        assert time.monotonic() < deadline, "no prompt tokens under the prefill role"
        time.sleep(0.1)
    assert settle(svc) == 0, "blocks still held"

    # and back: a prefill engine moves to decode while streams run (its handoffs finish);
    # without engine_id the one named decode-N is picked among equals: names stay tidy
    reset_prefix_caches(svc)
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    w.wait_tokens(4)
    r = move(svc, "prefill", "decode")
    assert r.status_code == 200 and r.json()["moved"], r.text
    assert r.json()["engine_id"] == moved, r.json()
    # the streams it prefilled decode elsewhere: not listed as its own in the decode pool
    assert not requests_on(svc, moved)
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS, [r for r in w.results if r.error]
    assert ids(svc, "prefill") == {"prefill-0"} and ids(svc, "decode") == {"decode-0", "decode-1"}
    assert_registered_as(svc, moved, "decode")
    assert settle(svc) == 0, "blocks still held"


def test_refusals_name_the_field_and_change_nothing(svc_refs, monkeypatch):
    import ray

    svc, refs = svc_refs
    before = {role: ids(svc, role) for role in ("prefill", "decode")}
    (prefill_id,) = before["prefill"]  # an engine moved there and back keeps its name
    cases = [
        ("prefill", "decode", {}, "source_pool", "--prefill-min-engines"),
        ("decode", "decode", {}, "dest_pool", "already"),
        ("colocated", "prefill", {}, "source_pool", "colocated"),
        ("decode", "prefill", {"engine_id": "decode-9"}, "engine_id", "decode-9"),
        ("decode", "prefill", {"engine_id": prefill_id}, "engine_id", prefill_id),
    ]
    for source_pool, dest_pool, extra, param, named in cases:
        r = move(svc, source_pool, dest_pool, **extra)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and named in error["message"], error
    assert move(svc, "decode", "prefill", key="wrong").status_code == 401
    # pools whose engines differ (what ServeConfig.pool_moves_off() would say of them:
    # tests/cluster/test_pool_move_config.py) refuse every move, and /cluster/state says why
    why = "the pools' engines differ in max_num_seqs (prefill 128, decode 8: ...)"
    monkeypatch.setattr(svc.service.backend.scaler, "moves_off", why)
    assert cluster_state(svc)["pool_moves"] == {"enabled": False, "reason": why}
    r = move(svc, "decode", "prefill")
    assert r.status_code == 400 and r.json()["error"]["param"] == "pool_moves", r.text
    assert why in r.json()["error"]["message"]
    monkeypatch.undo()
    p = subprocess.run(
        [sys.executable, "-m", "tandem.cluster", "scale", "--move", "prefill:decode",
         "--url", svc.base_url],
        env=dict(os.environ, TANDEM_ADMIN_API_KEY=KEY),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "--prefill-min-engines" in p.stderr, p.stderr
    assert metric(svc, "tandem:scaling_actions_total", pool="decode", action="move",
                  outcome="refused") >= 1  # fmt: skip

    # an engine holding streams refuses to switch, naming role, and serves on
    reset_prefix_caches(svc)
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    w.wait_tokens(2)
    busy = max(ids(svc, "decode"), key=lambda eid: len(svc.service.backend.engines[eid].requests))
    actor = svc.service.backend.engines[busy].handle.actor
    with pytest.raises(ray.exceptions.RayTaskError, match=r"role: engine \S+ holds"):
        ray.get(actor.set_role.remote("prefill"), timeout=30)
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS
    assert {role: ids(svc, role) for role in ("prefill", "decode")} == before
    assert ray.get(actor.ready.remote(), timeout=30)["role"] == "decode"
    assert settle(svc) == 0, "blocks still held"


def test_a_moved_engine_that_ray_restarts_serves_its_new_pool(svc_refs):
    """Ray restarts an actor with its first arguments (the decode role): the
    gateway's probe sees the role differ and switches it back before it
    registers (Membership._restore_role)."""
    import ray

    from tests.chaos.service import wait_ready, wait_restarted

    svc, refs = svc_refs
    r = move(svc, "decode", "prefill")
    assert r.status_code == 200 and r.json()["moved"], r.text
    moved = r.json()["engine_id"]
    e = svc.service.backend.engines[moved]
    epoch, pid = e.state.epoch, ray.get(e.handle.actor.ready.remote(), timeout=30)["pid"]
    ray.kill(e.handle.actor, no_restart=False)
    wait_restarted(e.handle.actor, pid)
    wait_ready(svc, moved, new_epoch_after=epoch)
    assert_registered_as(svc, moved, "prefill")
    reset_prefix_caches(svc)
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS, [r for r in w.results if r.error]
    back = move(svc, "prefill", "decode", engine_id=moved)
    assert back.status_code == 200 and back.json()["moved"], back.text
    assert ids(svc, "prefill") == {"prefill-0"} and ids(svc, "decode") == {"decode-0", "decode-1"}
    assert settle(svc) == 0, "blocks still held"


def test_a_move_that_fails_leaves_the_engine_whole_in_its_pool(svc_refs, monkeypatch):
    """Failures roll back (cluster/disagg/pool_move.py): a switch the engine refuses
    leaves it undrained in its pool; a registration in the new pool that does not
    finish switches it back and registers it in the old one. Never half in both."""
    from tandem.cluster.disagg import pool_move

    svc, refs = svc_refs
    before = {role: ids(svc, role) for role in ("prefill", "decode")}

    async def refused(backend, e, role):  # a request reached it after its drain
        raise ValueError(f"role: engine {e.state.engine_id} holds 1 requests")

    monkeypatch.setattr(pool_move, "_set_role", refused)
    r = move(svc, "decode", "prefill", engine_id="decode-1")
    monkeypatch.undo()
    assert r.status_code == 200, r.text
    body = r.json()
    assert not body["moved"] and body["error"].startswith("role: engine decode-1 holds"), body
    deadline = time.monotonic() + 30  # undrained: the next health probe makes it ready
    while not svc.service.backend.engines["decode-1"].state.ready:
        assert time.monotonic() < deadline, "decode-1 not serving again"
        time.sleep(0.05)
    assert_registered_as(svc, "decode-1", "decode")
    assert {role: ids(svc, role) for role in ("prefill", "decode")} == before
    assert metric(svc, "tandem:scaling_actions_total", pool="prefill", action="move",
                  outcome="failed") == 1  # fmt: skip

    real = pool_move._wait_registered
    pools_tried = []

    async def first_fails(backend, e, deadline):
        pools_tried.append(e.state.role)
        if len(pools_tried) == 1:
            return f"not registered in the {e.state.role} pool in time"
        return await real(backend, e, deadline)

    monkeypatch.setattr(pool_move, "_wait_registered", first_fails)
    r = move(svc, "decode", "prefill", engine_id="decode-1")
    monkeypatch.undo()
    body = r.json()
    assert not body["moved"] and "not registered in the prefill pool" in body["error"], body
    assert pools_tried == ["prefill", "decode"]
    assert_registered_as(svc, "decode-1", "decode")
    assert {role: ids(svc, role) for role in ("prefill", "decode")} == before
    reset_prefix_caches(svc)
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS, [r for r in w.results if r.error]
    assert settle(svc) == 0, "blocks still held"


def test_the_planner_and_the_cli_move_through_the_same_call(svc_refs):
    """``--planner sla`` moves engines where the pools are alike: the runner's
    ``move`` (cluster/cli/planning.py ``pool_mover``) is the scaler's move_engine,
    logged with source planner; ``tandem scale --move`` calls the admin route."""
    from tandem.cluster.cli.planning import pool_mover

    svc, _ = svc_refs
    planner_move = pool_mover(svc.service.backend.scaler)
    assert planner_move is not None
    body = svc.run(planner_move("decode", "prefill"))
    assert body["moved"], body
    event = cluster_state(svc)["scaling"][0]  # newest first
    assert (event["action"], event["source"], event["engine_id"]) == (
        "move", "planner", body["engine_id"],
    )  # fmt: skip
    assert svc.run(planner_move("prefill", "decode"))["moved"]
    assert ids(svc, "prefill") == {"prefill-0"} and ids(svc, "decode") == {"decode-0", "decode-1"}
    # tandem scale --move, the command-line client of the admin route: there and back
    p = subprocess.run(
        [sys.executable, "-m", "tandem.cluster", "scale", "--move", "decode:prefill",
         "--engine-id", "decode-1", "--url", svc.base_url],
        env=dict(os.environ, TANDEM_ADMIN_API_KEY=KEY),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0 and '"moved": true' in p.stdout, p.stderr
    assert ids(svc, "prefill") == {"prefill-0", "decode-1"}
    p = subprocess.run(
        [sys.executable, "-m", "tandem.cluster", "scale", "--move", "prefill:decode",
         "--engine-id", "decode-1", "--url", svc.base_url],
        env=dict(os.environ, TANDEM_ADMIN_API_KEY=KEY),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0 and '"moved": true' in p.stdout, p.stderr
    assert ids(svc, "prefill") == {"prefill-0"} and ids(svc, "decode") == {"decode-0", "decode-1"}
    assert settle(svc) == 0, "blocks still held"
