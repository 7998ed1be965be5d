"""The simulator's cost model against one real run, with a loose bound
(issue 28; the tight latency figures, rounds and spreads are
benchmarks/simulator.py's).

A served 1P1D ``tiny`` replays a short trace; ``tandem profile`` times the
same engine alone, and ``tandem simulate`` replays the trace through the
real schedulers with that profile. What is compared is the engines' CPU
seconds over the trace (/proc/<pid>/stat) against the simulator's solo work
(the profile's cost of every step it scheduled), not latencies: a latency is
a timed assertion that the other test worker on two cores breaks by any
factor (docs/architecture.md, capacity planning), while CPU seconds count
only the engines' own work. The bound is wide; what it catches is a
simulator that has drifted from the engine it models (steps priced per
request instead of per batch, prompts prefilled twice, a decode step per
token charged as a prefill), which moves the work by multiples."""

from __future__ import annotations

import json

import pytest

from benchmarks._sim_breakdown import request_parts
from benchmarks.simulator import measure_profile, serve_and_replay, simulate, write_trace
from tests import shared_ray

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

FACTOR = 2.0  # simulated engine CPU within [measured / FACTOR, measured x FACTOR]
NUM_REQUESTS = 16


def test_simulated_engine_work_is_within_a_loose_factor_of_a_real_1p1d_run(tmp_path):
    trace, warmup = str(tmp_path / "trace.jsonl"), str(tmp_path / "warmup.jsonl")
    write_trace(trace, NUM_REQUESTS, 2.0, 0)
    write_trace(warmup, 4, 4.0, 1000)
    shared_ray.start()
    try:  # serve_and_replay checks every engine's integrity before the service stops
        real, _ = serve_and_replay(1, 1, trace, warmup)
    finally:
        shared_ray.release()
    assert real["num_failed"] == 0 and real["num_completed"] == NUM_REQUESTS, real["errors"]
    # the TTFT breakdown: every request's client stamps meet the gateway's record of it
    # and P's timings, and its parts are in the order the request went (one clock)
    assert len(real["stamps"]) == NUM_REQUESTS
    for stamp in real["stamps"]:
        parts = request_parts(stamp, real["rows"][stamp[0]])
        assert parts is not None and min(parts.values()) >= 0, parts
        assert sum(parts.values()) - parts["ttft"] == pytest.approx(parts["ttft"], rel=1e-6)
    profile = str(tmp_path / "profile.json")
    measure_profile(profile)
    with open(profile) as f:
        assert json.load(f)["host"]["engine_threads"] == 1  # the served engines' threads
    sim = simulate(profile, trace, 1, 1)
    assert sim["num_completed"] == NUM_REQUESTS
    assert set(sim["ttft_parts_ms"]) == {"path", "queue", "step", "ttft"}
    with open(trace) as f:  # both ran every answer to its trace length (ignore_eos)
        tokens = sum(json.loads(line)["output_length"] for line in f)
    assert real["total_output_tokens"] == tokens
    assert sim["output_token_throughput"] * sim["duration_s"] == pytest.approx(tokens)
    measured = real["cpu"]["engines"] * real["cpu"]["wall_s"]
    simulated = sim["engine_cpu_s"]
    assert measured / FACTOR <= simulated <= measured * FACTOR, (simulated, measured)
