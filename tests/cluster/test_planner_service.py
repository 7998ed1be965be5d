"""The running planner resizes a real pool (``--planner load``; local Ray,
the tiny model): with no traffic the decode pool goes from 2 engines to its
minimum; a queue past --planner-queue-high brings the second back; every
decision is on /metrics and /cluster/state with its reason and inputs."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests import shared_ray
from tests.chaos.harness import Workload, serve_config
from tests.chaos.service import settle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

# long enough that the queue outlives a few planner rounds on a fast, quiet machine: with 96
# tokens the tiny engines drained 12 streams before a round saw the queue (the test then
# waited 120 s for a scale-out that had no reason to happen)
STREAM_TOKENS = 480


def decode_engines(svc) -> int:
    return sum(e.state.role == "decode" for e in svc.service.backend.engines.values())


def scaled_in(svc) -> int:
    """Decode engines now, once the planner's scale-in is logged done (else -1)."""
    log = svc.service.backend.scaler.log
    done = any(e.source == "planner" and e.action == "scale_in" for e in list(log.events))
    return decode_engines(svc) if done else -1


def planner_decisions(svc) -> dict[tuple[str, str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(svc.base_url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tandem:planner_decisions_total":
                out[(s.labels["pool"], s.labels["action"], s.labels["reason"])] = s.value
    return out


def wait_for(what: str, cond, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.1)


def test_load_planner_scales_the_decode_pool_in_and_out():
    from tandem.cluster.cli.serve import ServiceThread

    shared_ray.start()
    config = serve_config(
        f"planner-{os.getpid()}",
        prefill=1,
        decode=2,
        prefill_max_engines=1,
        decode_max_engines=2,
        max_num_seqs=2,  # 12 streams leave a queue on each engine
        planner="load",
        planner_interval_s=0.5,
        planner_queue_high=2.0,
        planner_queue_low=0.5,
        planner_scale_out_cooldown_s=0.0,
        planner_scale_in_cooldown_s=0.0,
    )
    try:
        with ServiceThread(config) as svc:
            # decode to its minimum, the removed engine stopped and the action logged
            wait_for("no traffic: decode to its minimum", lambda: scaled_in(svc) == 1)
            state = httpx.get(svc.base_url + "/cluster/state", timeout=30).json()
            planner = state["planner"]
            assert planner["mode"] == "load" and planner["interval_s"] == 0.5
            ins = [d for d in planner["recent"] if d["action"] == "scale_in"]
            assert ins and ins[0]["pool"] == "decode" and ins[0]["reason"] == "no_traffic"
            assert {"queue_per_engine", "kv_usage"} <= set(ins[0]["inputs"])
            assert any(
                e["source"] == "planner" and e["action"] == "scale_in" and e["outcome"] == "ok"
                for e in state["scaling"]
            )
            w = Workload(svc.base_url, "greedy", 12, max_tokens=STREAM_TOKENS)
            wait_for("a queue: decode back to 2", lambda: decode_engines(svc) == 2)
            assert not any(w.finish())
            assert all(r.done and r.error is None for r in w.results), w.results
            # the planner's inputs: the backend's own per-request counts
            traffic = svc.service.backend.orchestrator.traffic
            # a request is counted finished just after its last event reaches the client
            wait_for("every request counted finished", lambda: traffic.finished == 12, 30.0)
            assert traffic.arrivals == 12
            assert traffic.output_tokens == traffic.requested_output_tokens == 12 * STREAM_TOKENS
            wait_for("idle again: decode to 1", lambda: decode_engines(svc) == 1)
            counted = planner_decisions(svc)
            assert counted[("decode", "scale_out", "queue_high")] >= 1, counted
            assert counted[("decode", "scale_in", "no_traffic")] >= 1, counted
            assert counted[("prefill", "hold", "at_min")] >= 1, counted
            assert settle(svc) == 0
    finally:
        shared_ray.release()
