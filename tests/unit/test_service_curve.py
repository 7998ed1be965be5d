"""The profile's served figures by count (cluster/planner/service_curve.py):
the step overhead by batch from a decode sweep, and a prompt step's extra
beside decoding streams; old profiles with one overhead still load."""

from __future__ import annotations

import json

import pytest

from tandem.cluster.planner.profile import Profile, load_profile, save_profile
from tandem.cluster.planner.service_curve import curve_at, parse_curve
from tandem.cluster.planner.simulator import SimRequest, Simulator
from tests.unit.test_simulator import profile


def test_a_curve_is_linear_between_its_points_and_flat_outside_them():
    points = parse_curve("step_overhead_s", [[1, 0.002], [4, 0.0008], [8, 0.0004]], 1)
    assert curve_at(points, 1) == pytest.approx(0.002)
    assert curve_at(points, 2) == pytest.approx(0.0016)  # a third of the way to 4
    assert curve_at(points, 6) == pytest.approx(0.0006)
    assert curve_at(points, 0.5) == pytest.approx(0.002)  # below the sweep: its first value
    assert curve_at(points, 32) == pytest.approx(0.0004)  # past it: its last, no slope
    assert parse_curve("step_overhead_s", 0.0005, 1) == [(1, 0.0005)]  # one number: flat
    assert curve_at([], 3) == 0.0


@pytest.mark.parametrize(
    "bad",
    [-1, "1 ms", [], [[1]], [[0, 0.001]], [[1, -0.001]], [[2, 0.001], [1, 0.002]],
     [[1, 0.001], [1, 0.002]], [[1, True]], {"1": 0.001}],
)  # fmt: skip
def test_a_bad_curve_names_its_field(bad):
    with pytest.raises(ValueError, match=r"service\.step_overhead_s"):
        parse_curve("step_overhead_s", bad, 1)


def test_old_and_new_service_shapes_load_and_round_trip(tmp_path):
    old = profile().to_json()
    old["service"] = {"request_latency_s": 0.004, "step_overhead_s": 0.0005}
    p = Profile.from_json(old)
    assert p.step_overhead(1) == p.step_overhead(16) == 0.0005  # one number: every batch
    assert p.prefill_beside_decode_s == [] and p.served_prefill_s(300, decoding=5) == (
        pytest.approx(p.prefill_s(300) + 0.0005)
    )
    assert p.to_json()["service"] == {**old["service"], "prefill_overhead_s": 0.0}
    new = profile().to_json()
    new["service"] = {
        "request_latency_s": 0.004,
        "step_overhead_s": [[1, 0.002], [4, 0.0008]],
        "prefill_overhead_s": 0.003,
        "prefill_beside_decode_s": [[0, 0.0], [2, 0.004]],
    }
    f = tmp_path / "p.json"
    f.write_text(json.dumps(new))
    q = load_profile(str(f))
    assert q.step_overhead(2) == pytest.approx(0.0016)
    assert q.step_s(0.001, batch=4) == pytest.approx(0.0018)
    # a prompt step: the batch-1 overhead, the lone extra, and the extra beside decoding
    assert q.served_prefill_s(300) == pytest.approx(q.prefill_s(300) + 0.002 + 0.003)
    assert q.served_prefill_s(300, decoding=1) == pytest.approx(q.served_prefill_s(300) + 0.002)
    assert q.served_prefill_s(300, decoding=9) == pytest.approx(q.served_prefill_s(300) + 0.004)
    save_profile(q, str(f))
    assert load_profile(str(f)).to_json()["service"] == new["service"]
    for bad in ([[0, 0.0], [2, "x"]], 0.004):  # a number would add to a lone prompt too
        new["service"]["prefill_beside_decode_s"] = bad
        with pytest.raises(ValueError, match=r"service\.prefill_beside_decode_s"):
            Profile.from_json(new)


def test_decode_steps_take_the_overhead_at_their_batch():
    """A pair decoding together on one engine steps at the curve's batch-2
    value; a lone stream at its batch-1 value: each the same gaps as a flat
    overhead of that value (the prompt step takes the batch-1 value)."""
    pair = [SimRequest(1.0, list(range(300)), 4), SimRequest(1.0, list(range(1000, 1300)), 4)]
    lone = [SimRequest(1.0, list(range(300)), 4)]

    def gaps(overhead, reqs):
        p = profile()
        p.step_overhead_s = overhead
        recs = Simulator(p, 1, 1).run(reqs)
        return [b - a for r in recs for a, b in zip(r.token_times, r.token_times[1:])]

    curve = [[1, 0.002], [4, 0.0008]]
    assert gaps(curve, pair) == pytest.approx(gaps(0.0016, pair))
    assert gaps(curve, lone) == pytest.approx(gaps(0.002, lone))
    assert gaps(curve, pair) != pytest.approx(gaps(0.002, pair))


def test_a_prompt_step_beside_decoding_streams_takes_the_extra_for_their_count():
    p = profile()
    p.prefill_beside_decode_s = [[0, 0.0], [1, 0.005], [3, 0.009]]
    # the first request decodes 50 tokens when the second one's prompt is computed
    first, second = Simulator(p, 1, 1).run(
        [SimRequest(1.0, list(range(300)), 50), SimRequest(1.2, list(range(1000, 1200)), 2)]
    )
    assert first.token_times[0] - first.first_step_s == pytest.approx(p.served_prefill_s(300))
    assert first.token_times[0] < second.first_step_s < first.token_times[-1]
    assert second.token_times[0] - second.first_step_s == pytest.approx(
        p.served_prefill_s(200) + 0.005
    )


def test_the_idle_curve_loads_round_trips_and_old_profiles_have_none(tmp_path):
    old = profile().to_json()
    old["service"] = {"request_latency_s": 0.004, "step_overhead_s": 0.0005,
                      "prefill_overhead_s": 0.002}  # fmt: skip
    p = Profile.from_json(old)
    assert p.prefill_after_idle_s == []  # absent: 0 at every idle time
    assert p.served_prefill_s(300, idle_s=5.0) == p.served_prefill_s(300)
    assert "prefill_after_idle_s" not in p.to_json()["service"]
    new = profile().to_json()
    new["service"] = {**old["service"], "prefill_after_idle_s": [[0.02, 0.0], [1.0, 0.004]]}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(new))
    q = load_profile(str(f))
    base = q.served_prefill_s(300)
    assert q.served_prefill_s(300, idle_s=0.0) == pytest.approx(base)  # back to back
    assert q.served_prefill_s(300, idle_s=0.51) == pytest.approx(base + 0.002)  # linear
    assert q.served_prefill_s(300, idle_s=float("inf")) == pytest.approx(base + 0.004)
    save_profile(q, str(f))
    assert load_profile(str(f)).to_json()["service"] == new["service"]
    for bad in ([[0.5, 0.001], [0.1, 0.002]], [[-1, 0.0]], 0.003):
        new["service"]["prefill_after_idle_s"] = bad
        with pytest.raises(ValueError, match=r"service\.prefill_after_idle_s"):
            Profile.from_json(new)


def test_a_prompt_step_takes_the_idle_extra_from_its_engines_own_idle_time():
    """The first prompt meets an engine that never stepped (idle without end:
    the curve's last value); the second arrives during the first's step (no
    idle: its step follows at once); the third after a pause, measured from
    the end of the prefill engine's last step; the same inputs give the same
    records."""
    p = profile()
    p.prefill_after_idle_s = [[0.0, 0.0], [1.0, 0.01], [2.0, 0.02]]
    reqs = [SimRequest(1.0, list(range(300)), 2), SimRequest(1.01, list(range(1000, 1200)), 2),
            SimRequest(2.5, list(range(2000, 2100)), 2)]  # fmt: skip
    a, b, c = Simulator(p, 1, 1).run(reqs)
    assert a.token_times[0] - a.first_step_s == pytest.approx(p.served_prefill_s(300) + 0.02)
    assert b.first_step_s == pytest.approx(a.token_times[0])  # P's next step, no idle
    assert b.token_times[0] - b.first_step_s == pytest.approx(p.served_prefill_s(200))
    idle = c.first_step_s - b.token_times[0]  # since P's last step (b's) ended
    assert 1.0 < idle < 2.0
    assert c.token_times[0] - c.first_step_s == pytest.approx(
        p.served_prefill_s(100) + 0.01 + 0.01 * (idle - 1.0)
    )
    again = Simulator(p, 1, 1).run(reqs)
    assert [r.token_times for r in again] == [r.token_times for r in (a, b, c)]
    p.prefill_after_idle_s = []
    plain = Simulator(p, 1, 1).run(reqs)
    assert plain[2].token_times[0] - plain[2].first_step_s == pytest.approx(p.served_prefill_s(100))
