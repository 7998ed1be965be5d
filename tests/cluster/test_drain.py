"""Drain on the real service (local Ray, 1 prefill + 2 decode engines, tiny
model), by the HTTP admin call and by ``tandem drain``: under 8 concurrent
seeded streams the drained engine's streams migrate away and finish
token-identical to an undisturbed run; the engine ends idle (nothing running,
no block held, check_integrity) and gets no new work while drained; after
undrain it takes work again. Refused calls answer in the OpenAI envelope.
A drained stream whose context the other decode engine holds cached moves
there and recomputes what it lacks, without the prefill engine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tests import shared_ray
from tests.chaos.harness import Workload, serve_config, verdict
from tests.chaos.service import engine, requests_on, reset_prefix_caches, stats, wait_ready
from tests.cluster.test_kv_routing_service import RequestLog

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

KEY = "drain-test-admin-key"
NUM_STREAMS = 8
MAX_TOKENS = 256  # streams still run when the drain lands (the CLI starts a process)


@pytest.fixture(scope="module")
def svc_refs():
    from tandem.cluster.cli.serve import ServiceThread

    shared_ray.start()
    try:
        with ServiceThread(serve_config(f"drain-{os.getpid()}", admin_api_key=KEY)) as svc:
            ref = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
            assert not any(ref.finish())
            assert all(r.done and r.error is None for r in ref.results), ref.results
            yield svc, ref.results
    finally:
        shared_ray.release()


@pytest.fixture(autouse=True)
def undrain_after(svc_refs):
    """A failed test must not leave an engine drained for the next one."""
    yield
    svc, _ = svc_refs

    async def undrain_all() -> None:
        for eid in ("decode-0", "decode-1"):
            svc.service.backend.undrain(eid)

    svc.run(undrain_all())


def admin(svc, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(svc.base_url + path, json=body, headers=headers, timeout=120)


def tandem_drain(svc, *args: str, key: str = KEY) -> subprocess.CompletedProcess:
    env = dict(os.environ, TANDEM_ADMIN_API_KEY=key)
    return subprocess.run(
        [sys.executable, "-m", "tandem.cluster", "drain", *args, "--url", svc.base_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def handle(svc, engine_id: str):
    return next(h for h in svc.service.handles if h.engine_id == engine_id)


def assert_idle(svc, engine_id: str):
    """Nothing running or waiting, no KV block in use or held, integrity holds."""
    import ray

    s = stats(handle(svc, engine_id))
    q = s.scheduler
    assert (q.num_running_reqs, q.num_waiting_reqs, q.num_waiting_for_remote_kvs) == (0, 0, 0)
    assert (q.kv_cache_usage, q.num_blocks_held_for_transfer) == (0.0, 0)
    assert ray.get(handle(svc, engine_id).actor.check_integrity.remote(), timeout=30)
    return s


def drain_under_load(svc, refs, drain) -> str:
    """8 seeded streams; once each has 4 tokens, ``drain(engine_id)`` the
    decode engine holding the most. Asserts every stream identical to the
    undisturbed run and the engine idle. Returns the drained engine id."""
    reset_prefix_caches(svc)
    backend = svc.service.backend
    before = backend.migrator.num_migrations.get("drain", 0)
    w = Workload(svc.base_url, "seeded", NUM_STREAMS, max_tokens=MAX_TOKENS)
    w.wait_tokens(4)
    held = {eid: requests_on(svc, eid) for eid in ("decode-0", "decode-1")}
    target = max(held, key=lambda eid: len(held[eid]))
    assert held[target], held
    drain(target, len(held[target]))
    hung = w.finish()
    verdicts = [verdict(r, x, h) for r, x, h in zip(w.results, refs, hung, strict=True)]
    assert verdicts == ["identical"] * NUM_STREAMS, [r for r in w.results if r.error]
    # the streams that were still running when it drained moved (a stream may
    # have finished between the snapshot and the drain)
    assert 1 <= backend.migrator.num_migrations.get("drain", 0) - before <= len(held[target])
    assert_idle(svc, target)
    return target


def assert_no_new_work_then_undrain(svc, target: str, undrain) -> None:
    """While drained: a workload runs on the other engine only. After
    ``undrain()``: the engine is routed to and computes again."""
    assert not engine(svc, target).state.ready
    health = httpx.get(svc.base_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    before = assert_idle(svc, target)
    steps = before.num_steps
    w = Workload(svc.base_url, "greedy", NUM_STREAMS, max_tokens=8)
    assert not any(w.finish()) and all(r.finish_reason == "length" for r in w.results)
    after = assert_idle(svc, target)
    assert after.num_steps == steps, "a drained engine stepped"
    assert after.scheduler.prefix_cache_queries == before.scheduler.prefix_cache_queries
    undrain()
    wait_ready(svc, target, deadline_s=60)
    # new prompts, caches forgotten: least load spreads 8 streams over both
    reset_prefix_caches(svc)
    deadline = time.monotonic() + 120
    while stats(handle(svc, target)).num_steps == steps:
        assert time.monotonic() < deadline, f"{target} took no work after undrain"
        w = Workload(svc.base_url, "greedy", NUM_STREAMS, max_tokens=8)
        assert not any(w.finish()) and all(r.finish_reason == "length" for r in w.results)
    assert_idle(svc, target)


def test_drain_by_http_migrates_identical_and_idles(svc_refs):
    svc, refs = svc_refs

    def drain(engine_id: str, num_held: int) -> None:
        r = admin(svc, "/admin/drain", {"engine_id": engine_id})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["engine_id"] == engine_id and body["draining"] and body["idle"]
        assert 1 <= body["migrated"] <= num_held

    target = drain_under_load(svc, refs, drain)

    def undrain() -> None:
        r = admin(svc, "/admin/undrain", {"engine_id": target})
        assert r.status_code == 200 and r.json() == {"engine_id": target, "draining": False}

    assert_no_new_work_then_undrain(svc, target, undrain)


def test_drain_by_cli_migrates_identical_and_idles(svc_refs):
    svc, refs = svc_refs

    def drain(engine_id: str, num_held: int) -> None:
        p = tandem_drain(svc, engine_id)
        assert p.returncode == 0, p.stderr
        assert '"idle": true' in p.stdout

    target = drain_under_load(svc, refs, drain)

    def undrain() -> None:
        p = tandem_drain(svc, target, "--undo")
        assert p.returncode == 0, p.stderr
        assert '"draining": false' in p.stdout

    assert_no_new_work_then_undrain(svc, target, undrain)


def test_refused_admin_calls_answer_in_the_openai_envelope(svc_refs):
    svc, _ = svc_refs
    cases = [
        ({"engine_id": "decode-0"}, None, 401, "authentication_error"),
        ({"engine_id": "decode-0"}, "wrong-key", 401, "authentication_error"),
        ({"engine_id": "decode-9"}, KEY, 400, "invalid_request_error"),
        ({"engine": "decode-0"}, KEY, 400, "invalid_request_error"),
    ]
    for path in ("/admin/drain", "/admin/undrain"):
        for body, key, status, kind in cases:
            r = admin(svc, path, body, key=key)
            assert r.status_code == status, (path, body, key, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["type"] == kind, error
    r = admin(svc, "/admin/drain", {"engine_id": "decode-9"})
    assert "decode-9" in r.json()["error"]["message"]
    assert "decode-0" in r.json()["error"]["message"]  # names the engines there are
    p = tandem_drain(svc, "decode-0", key="wrong-key")
    assert p.returncode == 2 and "401" in p.stderr
    p = tandem_drain(svc, "decode-9")
    assert p.returncode == 2 and "decode-9" in p.stderr
    # nothing was drained by the refused calls
    assert all(not engine(svc, eid).draining for eid in ("decode-0", "decode-1"))


def test_drained_stream_moves_to_the_decode_engine_holding_its_context(svc_refs):
    """Both decode engines hold a 600-token prompt in their prefix cache; a
    greedy stream of it runs on one, which is drained. The context is past
    ``--migration-handoff-min-tokens`` (256), which alone used to send the
    stream through the prefill engine; the other decode engine lacks only
    the tokens sent so far (< 256), so it recomputes them itself."""
    svc, _ = svc_refs
    backend = svc.service.backend
    decoders = ("decode-0", "decode-1")
    prompt = [3 + (i * 7) % 200 for i in range(600)]
    max_tokens = 240  # a context lacks at most 600 % 16 + 240 < 256 tokens
    reset_prefix_caches(svc)
    refs = []
    for eid in decoders:  # each drained in turn: the prompt is computed on the other
        r = admin(svc, "/admin/drain", {"engine_id": eid})
        assert r.status_code == 200 and r.json()["idle"], r.text
        w = Workload(svc.base_url, "greedy", 1, prompts=[prompt], max_tokens=max_tokens)
        assert not any(w.finish()) and w.results[0].finish_reason == "length", w.results
        refs.append(w.results[0])
        assert admin(svc, "/admin/undrain", {"engine_id": eid}).status_code == 200
        wait_ready(svc, eid, deadline_s=60)
    assert refs[0].tokens == refs[1].tokens
    hashes = backend.routing.hashes(EngineRequest("probe", prompt, SamplingParams())).of("decode")
    full = dict.fromkeys(decoders, len(hashes))
    deadline = time.monotonic() + 30
    while backend.routing.index.match(hashes, list(decoders)) != full:
        assert time.monotonic() < deadline, "the prefix index never saw both engines hold it"
        time.sleep(0.05)
    p_queries = stats(handle(svc, "prefill-0")).scheduler.prefix_cache_queries
    decisions = backend.routing.decisions()
    with RequestLog() as log:
        w = Workload(svc.base_url, "greedy", 1, prompts=[prompt], max_tokens=max_tokens)
        w.wait_tokens(4)
        (source,) = [eid for eid in decoders if requests_on(svc, eid)]
        (dest,) = [eid for eid in decoders if eid != source]
        r = admin(svc, "/admin/drain", {"engine_id": source})
        assert r.status_code == 200 and r.json()["migrated"] == 1, r.text
        assert not any(w.finish())
        (line,) = log.wait_lines(1)
    assert verdict(w.results[0], refs[0], False) == "identical", w.results[0]
    assert (line["decode_engine"], line["decode_reason"]) == (dest, "prefix_hit"), line
    assert line["route_reason"] == "migration_recompute" and "prefill_engine" not in line, line
    after = backend.routing.decisions()
    assert (
        after.get("route/migration_recompute", 0)
        == decisions.get("route/migration_recompute", 0) + 1
    )
    assert after.get("route/migration_handoff", 0) == decisions.get("route/migration_handoff", 0)
    # the stream started on a holder (no P: decode_holds_prompt) and moved to one
    assert stats(handle(svc, "prefill-0")).scheduler.prefix_cache_queries == p_queries
    assert_idle(svc, source)
