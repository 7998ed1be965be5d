"""The simulator against a real 1P1D run, with a loose bound (the tight figures,
three configurations and the 15% target, are benchmarks/simulator.py's).

A profile of this machine's tiny engine (the served engines' limits, a small
grid) and a short trace at a low rate; the same trace replayed through a real
service (local Ray, NIXL over loopback, benchmarks/simulator.py's client) and
through ``Simulator``. The predicted TTFT p50 and ITL p50 must be within a
factor (20) of the measured: what this catches is a simulator off by an order
of magnitude (seconds for milliseconds, a step cost of the wrong kind), not the
noise of a shared machine, which moved the ratio to 4-5x in full CI runs."""

from __future__ import annotations

import asyncio
import copy

import pytest

from benchmarks import simulator as bench_sim
from tandem.cluster.cli.trace_replay import trace_workload
from tandem.cluster.planner.measure import measure
from tandem.cluster.planner.metrics import summarize
from tandem.cluster.planner.profile import Profile
from tandem.cluster.planner.simulator import SimRequest, Simulator
from tests.cluster.service_helpers import tiny_pd_service

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16, "max_model_len": 512, "torch_threads": 1}
# Loose: predicted within [measured / 20, measured x 20]. This test runs beside the other
# test worker, and two full CI runs on 2 cores put the ratio at 4.2x (engine-only figures,
# predicted low) and 5x (service figures probed while the other worker loaded the box,
# predicted high): the machine's load moves it that far, so the bound only catches an
# order-of-magnitude error (seconds for milliseconds, a step cost of the wrong kind). The
# 15% comparison is benchmarks/simulator.py's, on a quiet box.
FACTOR = 20.0


def test_predicted_ttft_and_itl_p50_are_within_a_loose_bound_of_a_real_1p1d_run(tmp_path):
    profile = measure(
        "tiny",
        repeats=2,
        prefill_tokens=[16, 64, 128, 256],
        batch_sizes=[1, 4],
        context_tokens=[64, 256],
        engine_overrides=dict(ENGINE, max_num_batched_tokens=512),
    )
    trace = str(tmp_path / "trace.jsonl")
    bench_sim.write_trace(trace, 12, 2.0, seed=5, input_tokens=(32, 256), output_tokens=(8, 32))
    warmup = str(tmp_path / "warmup.jsonl")
    bench_sim.write_trace(warmup, 3, 4.0, seed=6, input_tokens=(32, 64), output_tokens=(4, 8))
    probe = str(tmp_path / "probe.jsonl")
    bench_sim.write_probe(probe, 6, 0.3)
    # tiny_pd_service's engines: 256 KV blocks, 16 sequences, 512 tokens (ENGINE)
    with tiny_pd_service(
        disagg_min_tokens=0, router="least-load", max_num_batched_tokens=512, torch_threads=1
    ) as svc:
        asyncio.run(bench_sim.replay(svc.base_url, warmup, 1))
        probed = asyncio.run(bench_sim.replay(svc.base_url, probe, 2))
        real = asyncio.run(bench_sim.replay(svc.base_url, trace, 0))
        assert all(svc.run(svc.service.backend.call_all("check_integrity")).values())
    assert real["num_failed"] == 0, real["errors"]
    prompts, outs, offsets = trace_workload(trace, 32000, 0, 1.0, 512)
    work = [SimRequest(t, p, o) for p, o, t in zip(prompts, outs, offsets)]
    # the serving path's own figures, probed on the same service just before the trace
    # (as the benchmark does): they carry whatever the machine's load does to that path
    served = Profile.from_json(bench_sim.service_figures(profile.to_json(), probed))
    sim = summarize(Simulator(served, 1, 1).run(copy.deepcopy(work)))
    assert sim["num_completed"] == real["num_completed"] == 12
    for key in ("ttft_ms", "itl_ms"):
        predicted, measured = sim[key]["p50"], real[key]["p50"]
        assert measured / FACTOR <= predicted <= measured * FACTOR, (key, predicted, measured)
