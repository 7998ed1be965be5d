"""benchmarks/_sim_own.py (``simulator.py --probe-each``): each configuration
predicted from the median of its own probes, the first configuration's for all
beside it, and the ``--save`` file read back, old and new. Known numbers; no
service."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from benchmarks._sim_figures import median_figures, predict_ways, service_figures
from benchmarks._sim_own import engines_met, per_config, probe_sets, routing_line, saved_probes
from benchmarks._sim_rounds import predict_by_round
from tests.unit.test_sim_benchmark import _probe, _row, _run
from tests.unit.test_sim_sweep import probe_with_sweep
from tests.unit.test_simulator import profile

NAMES = ("1P1D", "1P2D", "2P1D")


def _probes(itl_ms: float) -> list[dict]:
    """Three rounds' probes whose ITL p50 marks the configuration (the median
    is the middle one's, ``itl_ms``)."""
    return [_probe(30.0, itl_ms - 1.0), _probe(30.0, itl_ms), _probe(30.0, itl_ms + 2.0)]


def _reals() -> dict[str, list[dict]]:
    runs = [{**_run(20.0, 2.0), "cpu": {"others": x}} for x in (0.1, 0.2, 0.3)]
    return {n: json.loads(json.dumps(runs)) for n in NAMES}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def test_a_list_is_every_configurations_probes_a_dict_each_ones_own():
    first = _probes(9.0)
    assert per_config(first, NAMES) == {n: first for n in NAMES}
    own = {n: _probes(k) for n, k in zip(NAMES, (9.0, 10.0, 11.0), strict=True)}
    assert per_config(own, NAMES) == own
    with pytest.raises(ValueError, match="no probes for 2P1D"):
        per_config({"1P1D": first, "1P2D": first}, NAMES)


def test_each_configuration_gets_the_median_of_its_own_probes(tmp_path):
    p = {**profile().to_json(), "host": {"cores": 2, "engine_threads": 1}}
    base = str(tmp_path / "engine.json")
    own = {n: _probes(k) for n, k in zip(NAMES, (9.0, 10.0, 11.0), strict=True)}
    reals = _reals()
    first = predict_ways(str(tmp_path), base, p, own["1P1D"], reals)
    each = predict_ways(str(tmp_path), base, p, own, reals, own=True)
    assert list(first) == ["engine", "engine + service", "+ shared cores",
                           "+ shared cores + background"]  # fmt: skip
    assert list(each) == [w + ", own probe" for w in list(first)[1:]]  # no engine-only way
    for n, k in zip(NAMES, (9.0, 10.0, 11.0), strict=True):
        want = median_figures(p, own[n], service_figures)["service"]
        got = _load(each["engine + service, own probe"][n])["service"]
        assert got == pytest.approx(want)
        # the median probe's figure: the ITL of the middle one, less the profile's step
        assert got["step_overhead_s"] == pytest.approx(
            service_figures(p, _probe(30.0, k))["service"]["step_overhead_s"]
        )
        # without --probe-each every configuration has the first configuration's figures
        assert _load(first["engine + service"][n])["service"] == pytest.approx(
            _load(each["engine + service, own probe"]["1P1D"])["service"]
        )
        # the background is each configuration's traces' own either way
        assert _load(each["+ shared cores + background, own probe"][n])["host"][
            "background_cores"
        ] == pytest.approx(0.2)
    steps = {n: _load(each["+ shared cores, own probe"][n])["service"] for n in NAMES}
    assert steps["1P1D"]["step_overhead_s"] < steps["1P2D"]["step_overhead_s"]
    assert steps["1P2D"]["step_overhead_s"] < steps["2P1D"]["step_overhead_s"]
    # no probes at all (a configuration without its own): the engine-only way alone
    assert list(predict_ways(str(tmp_path), base, p, [], reals)) == ["engine"]


def test_probes_with_an_idle_pass_add_the_no_idle_way_per_configuration(tmp_path):
    prof, probe, _ = probe_with_sweep()
    p = {**prof.to_json(), "host": {"cores": 2, "engine_threads": 1}}
    probe["cpu"] = _probe(30.0, 9.0)["cpu"]
    probe.update(total_output_tokens=512, client_cpu_s=0.2, idle_cpu={"gateway": 0.02})
    probe["idle"] = {"layout": [], "per_request": [], "rows": {}}  # no idle points: no curve
    own = {n: [json.loads(json.dumps(probe))] for n in NAMES}
    reals = {n: runs[:1] for n, runs in _reals().items()}
    each = predict_ways(str(tmp_path), "engine.json", p, own, reals, own=True)
    assert set(each["+ shared cores, no idle term, own probe"]) == set(NAMES)


def test_each_round_is_predicted_from_that_rounds_probe_of_the_same_configuration(tmp_path):
    base = {**profile().to_json(), "host": {"cores": 2, "engine_threads": 1}}
    # a marker per (round, configuration): the probe's ITL p50, 10 x round + configuration
    own = {n: [_probe(30.0, 10.0 * r + c) for r in (1, 2, 3)] for c, n in enumerate(NAMES, 1)}
    reals = {n: [_run(20.0, 2.0)] * 3 for n in NAMES}
    overhead = {}
    for n, probes in own.items():
        for r, pr in enumerate(probes):
            fig = service_figures(base, pr)["service"]["step_overhead_s"]
            overhead[round(fig, 9)] = (r, n)
    seen = []

    def fake_simulate(path: str, name: str) -> dict:
        fig = _load(path)["service"]["step_overhead_s"]
        seen.append((overhead[round(fig, 9)], name))
        return _run(20.0, 2.0)

    assert predict_by_round(str(tmp_path), base, [], own, reals, fake_simulate, tag="-each")
    assert sorted(seen) == sorted(((r, n), n) for r in range(3) for n in NAMES)
    seen.clear()  # the first configuration's probes: round r's for every configuration
    predict_by_round(str(tmp_path), base, [], own["1P1D"], reals, fake_simulate)
    assert sorted(seen) == sorted(((r, "1P1D"), n) for r in range(3) for n in NAMES)
    # a configuration short of a probe in some round: no such table
    short = {**own, "2P1D": own["2P1D"][:2]}
    assert predict_by_round(str(tmp_path), base, [], short, reals, fake_simulate) is None


def test_a_saved_run_is_read_back_old_and_new(tmp_path):
    first = _probes(9.0)
    own = {n: _probes(k) for n, k in zip(NAMES, (9.0, 10.0, 11.0), strict=True)}
    own["1P1D"] = first
    reals = _reals()
    # kept before --probe-each: the first configuration's probes only
    old = json.loads(json.dumps({"probes": first, "real": reals}))
    assert probe_sets(old) == (first, None)
    # kept with it: the same list under probes (older readers), every one's under probes_each
    new = json.loads(json.dumps({**saved_probes(first, own), "real": reals}))
    assert new["probes"] == first
    got_first, got_own = probe_sets(new)
    assert got_first == first and got_own == own and list(got_own) == list(NAMES)
    assert saved_probes(first, None) == {"probes": first}
    # read back, the new file predicts both ways as the run did
    p = {**profile().to_json(), "host": {"cores": 2, "engine_threads": 1}}
    ways = predict_ways(str(tmp_path), "e.json", p, got_own, new["real"], own=True)
    assert _load(ways["engine + service, own probe"]["2P1D"])["service"] == pytest.approx(
        median_figures(p, own["2P1D"], service_figures)["service"]
    )


def test_the_probes_routing_is_counted_per_part_and_engine():
    probe = _probe(30.0, 9.0)
    probe["rows"] = {f"l{i}": {**_row(float(i)), "p_engine": "prefill-0"} for i in range(3)}
    probe["cached"] = {"rows": {"c": {**_row(0.0), "p_engine": "prefill-0"}}}
    probe["sweep"] = {
        "rows": {
            "s1": {**_row(0.0), "p_engine": "prefill-0", "d_engine": "decode-0"},
            "s2": {**_row(0.0), "p_engine": "prefill-1", "d_engine": "decode-1"},
            "s3": {**_row(0.0), "p_engine": "prefill-0", "d_engine": "decode-0"},
        }
    }
    got = engines_met(probe)
    assert got["lone"]["prefill"] == Counter({"prefill-0": 3})
    assert got["lone"]["decode"] == Counter()  # rows kept before d_engine: none counted
    assert got["sweep"]["prefill"] == Counter({"prefill-0": 2, "prefill-1": 1})
    assert "idle" not in got
    assert routing_line([_probe(30.0, 9.0)]) == "-"  # a probe kept without its rows
    line = routing_line([probe, probe])
    assert line == (
        "lone P prefill-0 6; cached P prefill-0 2; "
        "sweep P prefill-0 4 prefill-1 2, D decode-0 4 decode-1 2"
    )
