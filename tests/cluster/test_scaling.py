"""Pools that resize while serving (cluster/disagg/scaling.py), on the real
service: local Ray, the tiny model, 1 prefill + 1 decode engine at start.

- 1P1D -> 2P2D -> 1P1D under 8 seeded streams: every stream identical to the
  undisturbed run, no error; the new engines take work; the removed ones'
  actors are gone, their index entries and stats too; every remaining engine
  idle with check_integrity(), no block held.
- a prefill engine removed while its prefills and handoffs are in flight:
  they finish first, every stream identical.
- sizes outside --{pool}-min-engines / --{pool}-max-engines: 400 naming the
  flag (HTTP and tandem scale), nothing changes.
- an engine that cannot be placed (its pool's Ray resource is all taken): the
  start is reported failed, the pool serves on with the others.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.chaos.harness import Workload, serve_config, verdict
from tests.chaos.service import reset_prefix_caches, settle, stats

pytestmark = pytest.mark.slow

KEY = "scaling-test-admin-key"
NUM_STREAMS = 8
MAX_TOKENS = 128
# long prompts: their prefills and KV reads take a while (the in-flight test)
LONG_PROMPTS = [[5 + (i * 31 + j * 7) % 240 for j in range(480)] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def svc_refs():
    import ray

    from tandem.cluster.cli.serve import ServiceThread

    # two units of the decode pool's resource: a third decode engine finds no room
    ray.init(
        include_dashboard=False, num_cpus=2, log_to_driver=False, resources={"tandem_decode": 2}
    )
    config = serve_config(
        f"scaling-{os.getpid()}",
        admin_api_key=KEY,
        prefill=1,
        decode=1,
        prefill_max_engines=2,
        decode_max_engines=3,
        decode_ray_resources={"tandem_decode": 1},
        scale_start_timeout_s=20.0,
    )
    try:
        with ServiceThread(config) as svc:
            refs = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
            assert not any(refs.finish())
            long = Workload(
                svc.base_url, "greedy", NUM_STREAMS, prompts=LONG_PROMPTS, max_tokens=32
            )
            assert not any(long.finish())
            for r in refs.results + long.results:
                assert r.done and r.error is None and r.finish_reason == "length", r
            yield svc, refs.results, long.results
    finally:
        ray.shutdown()


def scale(svc, pool: str, engines, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{svc.base_url}/admin/pools/{pool}",
        json={"engines": engines},
        headers=headers,
        timeout=300,
    )


def tandem_scale(svc, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TANDEM_ADMIN_API_KEY=KEY)
    return subprocess.run(
        [sys.executable, "-m", "tandem.cluster", "scale", *args, "--url", svc.base_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def ids(svc, role: str) -> set[str]:
    return {eid for eid, e in svc.service.backend.engines.items() if e.state.role == role}


def cluster_state(svc) -> dict:
    return httpx.get(svc.base_url + "/cluster/state", timeout=30).json()


def metric(svc, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(svc.base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def assert_gone(svc, engine_id: str) -> None:
    """Its actor stopped, and nothing of it left in the gateway."""
    import ray

    backend = svc.service.backend
    assert engine_id not in backend.engines and engine_id not in backend.router.engines
    index = backend.routing.index
    if index is not None:
        assert engine_id not in index.engines
        index.check_integrity()
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get_actor(engine_id, namespace=svc.service.config.ray.ray_namespace)
        except ValueError:
            break
        assert time.monotonic() < deadline, f"actor {engine_id} still registered"
        time.sleep(0.1)
    assert engine_id not in {e["id"] for e in cluster_state(svc)["engines"]}


def assert_all_settled(svc) -> None:
    assert settle(svc) == 0, "blocks still held"


def test_scale_out_and_in_under_load_keeps_every_stream(svc_refs):
    svc, refs, _ = svc_refs
    reset_prefix_caches(svc)
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    w.wait_tokens(2)
    for pool in ("prefill", "decode"):
        r = scale(svc, pool, 2)
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["pool"], body["before"], body["engines"]) == (pool, 1, 2), body
        assert body["started"] == [f"{pool}-1"] and body["failed"] == [], body
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS, [r for r in w.results if r.error]
    assert ids(svc, "prefill") == {"prefill-0", "prefill-1"}
    assert ids(svc, "decode") == {"decode-0", "decode-1"}
    pools = {p["role"]: (p["engines"], p["ready"]) for p in cluster_state(svc)["pools"]}
    assert pools == {"prefill": (2, 2), "decode": (2, 2)}, pools
    assert metric(svc, "tandem:pool_engines", pool="decode") == 2

    # the new engines take work: fresh prompts spread over both pools
    handles = {h.engine_id: h for h in svc.service.handles}
    deadline = time.monotonic() + 120
    while not (stats(handles["decode-1"]).num_steps and stats(handles["prefill-1"]).num_steps):
        assert time.monotonic() < deadline, "the new engines took no work"
        reset_prefix_caches(svc)
        more = Workload(svc.base_url, "greedy", NUM_STREAMS, max_tokens=8)
        assert not any(more.finish()) and all(r.error is None for r in more.results)

    # back to 1P1D while streams run: decode streams migrate, prefills finish
    reset_prefix_caches(svc)
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    w.wait_tokens(4)
    r = scale(svc, "decode", 1)
    assert r.status_code == 200, r.text
    (stopped,) = r.json()["stopped"]
    assert stopped["idle"], r.json()
    p = tandem_scale(svc, "--prefill", "1")  # the CLI client of the same route
    assert p.returncode == 0, p.stderr
    assert '"engines": 1' in p.stdout
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS, [r for r in w.results if r.error]
    assert len(ids(svc, "decode")) == 1 and len(ids(svc, "prefill")) == 1
    assert_gone(svc, stopped["engine_id"])
    for role in ("prefill", "decode"):
        assert metric(svc, "tandem:pool_engines", pool=role) == 1
        for action in ("scale_out", "scale_in"):
            assert metric(svc, "tandem:scaling_actions_total", pool=role, action=action,
                          outcome="ok") >= 1  # fmt: skip
    events = cluster_state(svc)["scaling"]
    assert {(e["pool"], e["action"], e["outcome"]) for e in events} >= {
        ("decode", "scale_out", "ok"),
        ("decode", "scale_in", "ok"),
    }
    assert_all_settled(svc)


def test_prefill_removed_while_its_handoffs_are_in_flight(svc_refs):
    svc, _, long_refs = svc_refs
    assert scale(svc, "prefill", 2).status_code == 200
    backend = svc.service.backend
    reset_prefix_caches(svc)
    w = Workload(svc.base_url, "greedy", NUM_STREAMS, prompts=LONG_PROMPTS, max_tokens=32)

    async def both_prefilling() -> bool:
        engines = [e for e in backend.engines.values() if e.state.role == "prefill"]
        return len(engines) == 2 and all(e.state.num_inflight for e in engines)

    deadline = time.monotonic() + 60
    while not svc.run(both_prefilling()):
        assert time.monotonic() < deadline, "the prefill engines never both had work"
        time.sleep(0.005)
    r = scale(svc, "prefill", 1)
    assert r.status_code == 200, r.text
    (stopped,) = r.json()["stopped"]
    assert stopped["in_flight"]["prefills"] >= 1 and stopped["idle"], stopped
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, long_refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS, [r for r in w.results if r.error]
    assert_gone(svc, stopped["engine_id"])
    assert_all_settled(svc)


def test_sizes_outside_min_max_are_refused_naming_the_flag(svc_refs):
    svc, _, _ = svc_refs
    before = {role: ids(svc, role) for role in ("prefill", "decode")}
    cases = [
        ("decode", 0, "engines", "--decode-min-engines"),
        ("prefill", 3, "engines", "--prefill-max-engines"),
        ("colocated", 1, "pool", "colocated"),
        ("decode", "two", "engines", "engines"),
    ]
    for pool, n, param, named in cases:
        r = scale(svc, pool, n)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["param"] == param and named in error["message"], error
    assert scale(svc, "decode", 1, key="wrong").status_code == 401
    p = tandem_scale(svc, "--decode", "9")
    assert p.returncode == 2 and "--decode-max-engines" in p.stderr, p.stderr
    assert metric(svc, "tandem:scaling_actions_total", pool="decode", action="scale_out",
                  outcome="refused") >= 1  # fmt: skip
    assert {role: ids(svc, role) for role in ("prefill", "decode")} == before


def test_engine_that_cannot_be_placed_is_reported_and_the_pool_serves_on(svc_refs):
    """The decode pool's resource has room for two engines; a third waits
    for a node until --scale-start-timeout-s, is stopped and reported."""
    svc, refs, _ = svc_refs
    r = scale(svc, "decode", 3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["engines"] == 2 and len(body["started"]) == 1 and len(body["failed"]) == 1, body
    failed = body["failed"][0]
    assert "scale-start-timeout-s" in failed["error"], failed
    assert metric(svc, "tandem:scaling_actions_total", pool="decode", action="scale_out",
                  outcome="failed") == 1  # fmt: skip
    assert_gone(svc, failed["engine_id"])
    assert any(
        e["outcome"] == "failed" and e["engine_id"] == failed["engine_id"]
        for e in cluster_state(svc)["scaling"]
    )
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS
    assert scale(svc, "decode", 1).status_code == 200
    assert_all_settled(svc)
