"""KV-aware routing in the real service: 1 prefill + 2 decode tiny engines on
a local Ray, KV events over CURVE-authenticated ZMQ, NIXL handoff."""

from __future__ import annotations

import io
import json
import logging
import time

import httpx
import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tandem.cluster.observability.logging_setup import make_handler
from tests import shared_ray
from tests.cluster.service_helpers import client, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 16, "max_model_len": 1024}
PREFIXES = [
    f"Document {k}: " + f"the {k}th shared system prompt, word {k}. " * 12 for k in range(4)
]


@pytest.fixture(scope="module")
def svc():
    shared_ray.start()
    config = serve_config(
        model="tiny", ray_dashboard=False, max_restarts=2, prefill=1, decode=2, **ENGINE
    )
    try:
        with ServiceThread(config) as s:
            yield s
    finally:
        shared_ray.release()


def _complete(svc, prompt):
    r = client(svc).completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.usage


class RequestLog:
    """The ``tandem.request`` finished lines (JSON), while in its ``with``."""

    def __enter__(self):
        self.stream = io.StringIO()
        self.handler = make_handler("json", self.stream)
        self.logger = logging.getLogger("tandem.request")
        self.old_level = self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.old_level)

    def wait_lines(self, num, deadline_s=30.0) -> list[dict]:
        end = time.monotonic() + deadline_s
        while True:
            lines = [json.loads(x) for x in self.stream.getvalue().splitlines() if x]
            lines = [x for x in lines if x["message"] == "request finished"]
            if len(lines) >= num:
                return lines
            assert time.monotonic() < end, f"{len(lines)} finished lines, want {num}"
            time.sleep(0.05)


def _engine_hashes(svc) -> dict[str, set[bytes]]:
    snaps = svc.run(svc.service.backend.call_all("kv_events_snapshot"))
    return {eid: set(s.block_hashes) for eid, s in snaps.items()}


def _wait_index_equals_engines(svc, deadline_s=30.0):
    index = svc.service.backend.routing.index
    end = time.monotonic() + deadline_s
    while True:
        want = _engine_hashes(svc)
        got = {eid: index.hashes_of(eid) for eid in want}
        if got == want:
            index.check_integrity()
            return want
        assert time.monotonic() < end, "index differs from the engines' caches"
        time.sleep(0.1)


def _stats(svc):
    return svc.run(svc.service.backend.call_all("stats"))


def test_prefix_stays_on_its_decode_engine_and_full_hit_skips_prefill(svc):
    backend = svc.service.backend
    assert backend.routing.name == "kv-aware"
    plans = []
    plan = backend.routing.plan

    def recording_plan(hashes, wants_remote):
        p = plan(hashes, wants_remote)
        plans.append(p)
        return p

    backend.routing.plan = recording_plan
    try:
        home: dict[int, str] = {}
        for rep in range(3):
            for k, prefix in enumerate(PREFIXES):
                before = _stats(svc)
                with RequestLog() as log:
                    usage = _complete(svc, prefix)
                    (line,) = log.wait_lines(1)
                p = plans[-1]
                d = p.decode.engine.engine_id
                assert home.setdefault(k, d) == d, f"prefix {k} moved from {home[k]} to {d}"
                # the finished line carries the router's decision and both hits
                assert (line["router"], line["decode_engine"]) == ("kv-aware", d)
                assert line["route_reason"] == p.reason
                assert line["actual_hit_tokens"] == usage.prompt_tokens_details.cached_tokens
                assert line["predicted_hit_tokens"] == line["actual_hit_tokens"]
                after = _stats(svc)
                if rep == 0:
                    assert p.remote_prefill and usage.prompt_tokens_details.cached_tokens == 0
                    assert line["prefill_engine"] == "prefill-0"
                    assert line["path"] == "remote"
                    continue
                assert "prefill_engine" not in line and line["path"] == "local"
                # D holds the whole prompt: P is skipped, nothing is read over NIXL
                assert not p.remote_prefill and p.reason == "decode_holds_prompt"
                full = (usage.prompt_tokens - 1) // 16 * 16
                assert usage.prompt_tokens_details.cached_tokens == full
                assert p.decode.predicted_hit_tokens == full
                p_queries = [
                    st["prefill-0"].scheduler.prefix_cache_queries for st in (before, after)
                ]
                assert p_queries[0] == p_queries[1], "the prefill engine saw the request"
                bytes_read = {eid: s.kv_transfer.transfer_bytes_total for eid, s in after.items()}
                bytes_before = {
                    eid: s.kv_transfer.transfer_bytes_total for eid, s in before.items()
                }
                assert bytes_read == bytes_before, "a full hit on D still moved KV"
        assert len(set(home.values())) == 2, f"all prefixes on one engine: {home}"
    finally:
        backend.routing.plan = plan
    hist = backend.routing.hit_error
    assert hist.count >= 12 and hist.num_exact == hist.count, "prediction != reported hit"
    _wait_index_equals_engines(svc)
    wait_idle(svc)
    text = httpx.get(svc.base_url + "/metrics", timeout=10).text
    assert 'tandem:router_decisions_total{reason="decode_holds_prompt",role="route"} 8.0' in text
    exact = f'tandem:router_prefix_hit_error_tokens_bucket{{le="0.0"}} {float(hist.count)}'
    assert exact in text


def test_restarted_engine_entries_vanish_on_new_epoch(svc):
    import ray

    backend = svc.service.backend
    for prefix in PREFIXES:
        _complete(svc, prefix + " again")
    hashes = _wait_index_equals_engines(svc)
    victim = max(
        (eid for eid in hashes if eid.startswith("decode")), key=lambda eid: len(hashes[eid])
    )
    old = set(hashes[victim])
    assert old
    epoch = backend.engines[victim].state.epoch
    handle = next(h for h in svc.service.handles if h.engine_id == victim)
    ray.kill(handle.actor, no_restart=False)
    end = time.monotonic() + 180
    while backend.engines[victim].state.epoch in (epoch, 0) or not (
        backend.engines[victim].state.ready
    ):
        assert time.monotonic() < end, "decode engine did not come back"
        time.sleep(0.2)
    assert not backend.routing.index.hashes_of(victim) & old
    assert backend.routing.index.engines[victim].epoch == backend.engines[victim].state.epoch
    for prefix in PREFIXES:
        _complete(svc, prefix)
    _wait_index_equals_engines(svc)
    wait_idle(svc)
