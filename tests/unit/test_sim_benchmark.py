"""benchmarks/simulator.py's arithmetic: the inputs from several probes (the
median of each figure) and the rounds against one prediction (median,
min-max, each round's error). No service: known numbers only."""

from __future__ import annotations

import json

import pytest

from benchmarks._sim_breakdown import breakdown_table, median_parts, request_parts, run_parts
from benchmarks._sim_figures import (
    host_figures,
    median_figures,
    median_profile,
    probe_decode,
    probe_parts,
    probe_prefill,
    probe_spread,
    service_figures,
)
from benchmarks._sim_rounds import predict_by_round, round_errors
from benchmarks._sim_tables import median_run, rel, rounds_table, spread_table
from benchmarks.simulator import rotated
from tandem.cluster.planner.profile import Profile
from tests.unit.test_simulator import profile


def _probe(ttft_ms: float, itl_ms: float, gateway: float = 0.1, others: float = 0.0) -> dict:
    return {
        "ttft_ms": {"p50": ttft_ms},
        "itl_ms": {"p50": itl_ms},
        "total_output_tokens": 512,
        "client_cpu_s": 0.2,
        "cpu": {"wall_s": 8.0, "gateway": gateway, "client": 0.025, "others": others},
        "idle_cpu": {"gateway": 0.02},
    }


def _run(ttft: float, itl: float) -> dict:
    return {"ttft_ms": {"p50": ttft, "p99": 3 * ttft}, "itl_ms": {"p50": itl, "p99": 4 * itl}}


def test_service_figures_are_each_the_median_over_the_probes():
    p = profile().to_json()
    probes = [_probe(40.0, 9.0), _probe(30.0, 12.0), _probe(35.0, 6.0)]
    got = median_figures(p, probes, service_figures)["service"]
    each = [service_figures(p, pr)["service"] for pr in probes]
    # the median of every figure on its own: the overhead from the 9 ms probe, the
    # latency from the 35 ms one (12 ms ITL leaves the 30 ms probe the least latency)
    assert got["step_overhead_s"] == pytest.approx(each[0]["step_overhead_s"])
    assert got["request_latency_s"] == pytest.approx(
        sorted(e["request_latency_s"] for e in each)[1]
    )
    assert median_figures(p, probes[:1], service_figures) == service_figures(p, probes[0])
    assert probe_spread(probes, "itl_ms") == (9.0, 6.0, 12.0)
    with pytest.raises(ValueError, match="at least one probe"):
        median_figures(p, [], service_figures)


def test_host_figures_take_the_median_cpu_per_token_and_keep_the_cores():
    p = {**profile().to_json(), "host": {"cores": 2, "engine_threads": 1}}
    probes = [_probe(30.0, 6.0, gateway=g) for g in (0.10, 0.30, 0.05)]
    got = median_figures(p, probes, lambda pf, pr: host_figures(pf, pr, None))["host"]
    # (gateway - idle) x wall + the client's CPU, over the probe's tokens
    assert got["cpu_per_token_s"] == pytest.approx(((0.10 - 0.02) * 8.0 + 0.2) / 512)
    assert (got["cores"], got["engine_threads"], got["background_cores"]) == (2.0, 1.0, 0.0)


def test_rounds_are_compared_by_their_median_with_the_spread_and_each_rounds_error():
    runs = [_run(20.0, 2.0), _run(25.0, 2.4), _run(18.0, 1.8)]
    med = median_run(runs)
    assert med == {"ttft_ms": {"p50": 20.0, "p99": 60.0}, "itl_ms": {"p50": 2.0, "p99": 8.0}}
    sim = _run(22.0, 2.1)
    text = spread_table([("1P1D", sim, runs)])
    ttft = next(line for line in text.splitlines() if "TTFT p50" in line)
    assert "| 22.00 | 20.00 | 18.00-25.00 | +10.0% |" in ttft
    assert ttft.endswith(f"| {rel(22, 20):+.0%} {rel(22, 25):+.0%} {rel(22, 18):+.0%} |")
    assert "**over**" not in ttft
    far = spread_table([("1P1D", _run(30.0, 2.0), runs)])
    assert "+50.0% **over**" in far
    table = rounds_table({"1P1D": runs}, {"1P1D": [1.0, 2.5, 0.5]})
    assert table.splitlines()[3] == "| 2 | 25.00 / 2.40 (2.5) |"


def test_a_profile_per_round_gives_each_point_its_median():
    base = profile().to_json()
    runs = []
    for k in (1.0, 3.0, 2.0):
        p = json.loads(json.dumps(base))
        p["prefill"]["time_s"] = [t * k for t in p["prefill"]["time_s"]]
        p["decode"]["time_s"] = [[t * (4.0 - k) for t in row] for row in p["decode"]["time_s"]]
        runs.append(p)
    got = median_profile(runs)
    assert got["prefill"]["time_s"] == pytest.approx([t * 2.0 for t in base["prefill"]["time_s"]])
    for row, want in zip(got["decode"]["time_s"], base["decode"]["time_s"], strict=True):
        assert row == pytest.approx([t * 2.0 for t in want])
    assert got["scheduler"] == base["scheduler"] and got["transfer"] == base["transfer"]
    Profile.from_json(got)  # still a profile the simulator loads
    other = json.loads(json.dumps(base))
    other["decode"]["context_tokens"] = [16, 4096]
    with pytest.raises(ValueError, match="decode.context_tokens"):
        median_profile([base, other])


def test_each_configuration_runs_once_in_every_position_over_three_rounds():
    configs = [(1, 1), (1, 2), (2, 1)]
    orders = [rotated(configs, r) for r in range(3)]
    assert orders[0] == configs
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == sorted(configs)
    assert rotated(configs, 3) == configs and rotated([(1, 1)], 5) == [(1, 1)]


def test_the_path_latency_comes_from_the_cached_pass_whose_prefill_is_one_block():
    p = profile()
    slow = _probe(90.0, 9.0)  # the uncached pass's TTFT holds a 256-token prefill's waits
    slow["cached"] = {"ttft_ms": {"p50": 25.0}}
    overhead = 0.009 - p.decode_s(1, 256 + 16)
    # 256 prompt tokens, 16-token blocks: 15 blocks cached, the last 16 tokens computed
    assert probe_prefill(p.to_json(), slow) == (0.025, 16)
    got = service_figures(p.to_json(), slow)["service"]
    assert got["step_overhead_s"] == pytest.approx(overhead)
    assert got["request_latency_s"] == pytest.approx(0.025 - p.prefill_s(16) - overhead)
    fast = {**slow, "ttft_ms": {"p50": 40.0}}  # the uncached TTFT no longer matters
    assert service_figures(p.to_json(), fast)["service"] == got
    host = host_figures({**p.to_json(), "host": {"cores": 2, "engine_threads": 1}}, slow, None)
    assert host["service"]["request_latency_s"] == pytest.approx(got["request_latency_s"])
    # a run kept before the cached pass: the whole prefill, as before
    del slow["cached"]
    assert probe_prefill(p.to_json(), slow) == (0.090, 256)


def test_the_step_overhead_comes_from_the_paired_pass_as_a_batch_of_two():
    p = profile()
    probe = _probe(20.0, 9.0)  # a lone stream's ITL
    probe["paired"] = {"itl_ms": {"p50": 7.0}}
    context = 256 + 16
    assert probe_decode(p, probe) == (0.007, p.decode_s(2, 2 * context))
    got = service_figures(p.to_json(), probe)["service"]
    assert got["step_overhead_s"] == pytest.approx(0.007 - p.decode_s(2, 2 * context))
    host = host_figures({**p.to_json(), "host": {"cores": 2, "engine_threads": 1}}, probe, None)
    assert host["service"]["step_overhead_s"] == pytest.approx(got["step_overhead_s"])
    del probe["paired"]  # a run kept before the paired pass: the lone requests' ITL
    assert probe_decode(p, probe) == (0.009, p.decode_s(1, context))


def _row(sent_s: float, path: str = "remote", step_s: float = 0.012) -> dict:
    """The gateway's record of a 256-token request the client sent at
    ``sent_s`` (s): 1 ms to the route, 0.5 ms to dispatch, P received it 0.8
    ms later, queued 2 ms, computed ``step_s``, its output reached the gateway
    0.7 ms after; the rest of the client's TTFT is the SSE write and its read."""
    arrival = sent_s + 0.001
    return {
        "path": path,
        "arrival_s": arrival,
        "dispatch_s": arrival + 0.0005,
        "first_token_s": arrival + 0.0005 + 0.0008 + 0.002 + step_s + 0.0007,
        "prompt_tokens": 256,
        "scheduled_s": 0.002,
        "p_first_token_s": 0.002 + step_s,
        "finished_s": 0.002 + step_s,
    }


def test_a_served_ttft_is_taken_apart_from_the_client_gateway_and_engine_stamps():
    rows = {"a": _row(10.0), "b": _row(11.0), "local": _row(12.0, path="local")}
    stamps = [["a", 10.0, 0.020], ["b", 11.0, 0.020], ["local", 12.0, 0.02], ["gone", 13.0, 0.02]]
    parts = request_parts(stamps[0], rows["a"])
    assert parts == pytest.approx(
        {
            "http_in": 1.0,
            "gateway": 0.5,
            "hops": 1.5,
            "p_queue": 2.0,
            "p_step": 12.0,
            "p_out": 0.0,
            "sse_out": 3.0,
            "ttft": 20.0,
        }  # fmt: skip
    )
    assert sum(v for k, v in parts.items() if k != "ttft") == pytest.approx(parts["ttft"])
    assert request_parts(stamps[2], rows["local"]) is None  # no prefill engine: no P parts
    p = profile()
    got = run_parts(stamps, rows, p)  # the local and the unmatched request are left out
    assert got["n"] == 2 and got["p_step"] == pytest.approx(12.0)
    assert got["profile_step"] == pytest.approx(p.prefill_s(256) * 1000)
    assert run_parts([], rows) == {"n": 0}
    assert median_parts([got, {**got, "p_step": 20.0}, {**got, "p_step": 14.0}, {"n": 0}])[
        "p_step"
    ] == pytest.approx(14.0)
    sim = {"path": 6.5, "queue": 1.0, "step": 13.0, "ttft": 20.5}
    table = breakdown_table([("1P1D", got, sim), ("probe", got, {}), ("none", {}, sim)])
    lines = table.splitlines()
    assert len(lines) == 4  # the configuration without measured parts is left out
    # each simulated part against the measured parts it stands for: path = 1 + 0.5 + 1.5 + 3
    assert lines[2].endswith("| 6.50 (+0.50) | 1.00 (-1.00) | 13.00 (+1.00) | 20.50 (+0.50) |")
    assert lines[3].endswith("| - | - | - | - |")


def test_with_the_breakdown_the_path_is_measured_and_the_served_prefill_step_is_an_input():
    p = profile()
    probe = _probe(30.0, 9.0)
    probe["paired"] = {"itl_ms": {"p50": 7.0}}
    overhead = 0.007 - p.decode_s(2, 2 * (256 + 16))
    served_s = p.prefill_s(256) + overhead + 0.006  # the lone requests' step on P
    # the cached pass: a 4 ms path (1 + 0.5 + 1.5 + 1) around a 12 ms step
    probe["stamps"] = [[f"l{i}", float(i), 0.006 + served_s] for i in range(3)]
    probe["rows"] = {f"l{i}": _row(float(i), step_s=served_s) for i in range(3)}
    probe["cached"] = {
        "ttft_ms": {"p50": 18.0},
        "stamps": [[f"c{i}", float(i), 0.018] for i in range(3)],
        "rows": {f"c{i}": _row(float(i)) for i in range(3)},
    }
    assert probe_parts(probe) == pytest.approx((0.004, served_s))
    got = service_figures(p.to_json(), probe)["service"]
    assert got["request_latency_s"] == pytest.approx(0.004)
    assert got["step_overhead_s"] == pytest.approx(overhead)
    assert got["prefill_overhead_s"] == pytest.approx(0.006)
    served = Profile.from_json(service_figures(p.to_json(), probe))
    assert served.served_prefill_s(256) == pytest.approx(served_s)  # the probe's step again
    host = host_figures({**p.to_json(), "host": {"cores": 2, "engine_threads": 1}}, probe, None)
    assert host["service"] == pytest.approx(got)
    fast = {**probe, "rows": {k: _row(float(i), step_s=0.001) for i, k in enumerate(probe["rows"])}}
    assert service_figures(p.to_json(), fast)["service"]["prefill_overhead_s"] == 0.0
    del probe["rows"]  # a run kept before session 12: the cached TTFT's arithmetic, no extra
    old = service_figures(p.to_json(), probe)["service"]
    assert old["prefill_overhead_s"] == 0.0
    assert old["request_latency_s"] == pytest.approx(0.018 - p.prefill_s(16) - overhead)


def test_each_round_is_predicted_from_its_own_profile_and_probe(tmp_path):
    """Round r's prediction comes from round r's profile and probe (the file the
    fake simulator gets), and its error from round r's measurement; the figure
    is the median of the rounds' errors."""
    base = {**profile().to_json(), "host": {"cores": 2, "engine_threads": 1}}
    profiles = []
    for k in (1.0, 2.0, 3.0):  # a marker per round: the prefill table scaled by k
        p = json.loads(json.dumps(base))
        p["prefill"]["time_s"] = [t * k for t in p["prefill"]["time_s"]]
        profiles.append(p)
    probes = [_probe(30.0, 6.0) for _ in profiles]
    reals = {"1P1D": [_run(20.0, 2.0), _run(40.0, 2.0), _run(30.0, 3.0)]}
    seen = []

    def fake_simulate(path: str, name: str) -> dict:
        with open(path) as f:
            k = json.load(f)["prefill"]["time_s"][0] / base["prefill"]["time_s"][0]
        seen.append((round(k), name))
        return _run(20.0 * k, 2.0)  # round k: TTFT 20k, ITL 2

    text, worst = predict_by_round(str(tmp_path), base, profiles, probes, reals, fake_simulate)
    assert seen == [(1, "1P1D"), (2, "1P1D"), (3, "1P1D")]
    errors = round_errors(reals, {(r, "1P1D"): _run(20.0 * (r + 1), 2.0) for r in range(3)})
    assert errors["1P1D", "ttft_ms"] == pytest.approx([0.0, 0.0, 1.0])
    assert errors["1P1D", "itl_ms"] == pytest.approx([0.0, 0.0, rel(2.0, 3.0)])
    ttft = next(line for line in text.splitlines() if "TTFT" in line)
    assert ttft == "| 1P1D | TTFT p50 | +0% +0% +100% | +0.0% |"
    assert worst == pytest.approx(0.0)  # ITL's median error is 0 too
    # a run with fewer probes than rounds (given --profile, or kept before) has no such table
    assert predict_by_round(str(tmp_path), base, [], probes[:2], reals, fake_simulate) is None
