"""benchmarks/_sim_idle.py: the idle-gap probe's arithmetic (a prompt step's
extra by its prefill engine's idle time before it) from known numbers; no
service."""

from __future__ import annotations

import json

import pytest

from benchmarks._sim_figures import median_figures, service_figures
from benchmarks._sim_idle import (
    IDLE_GAPS_S,
    LEAD,
    base_step_s,
    beside_idle_s,
    idle_extras,
    idle_order,
    idle_points,
    lone_idle_s,
    median_points,
    monotone,
    p_steps,
    trace_idle_rows,
    write_idle,
)
from benchmarks._sim_sweep import PROBE_PROMPT, beside_extras
from tandem.cluster.planner.profile import Profile
from tandem.cluster.planner.service_curve import curve_at
from tests.unit.test_sim_benchmark import _row
from tests.unit.test_sim_sweep import flat, probe_with_sweep
from tests.unit.test_simulator import profile


def test_the_pauses_are_interleaved_every_one_once_a_repeat(tmp_path):
    order = idle_order(3)
    assert len(order) == 3 * len(IDLE_GAPS_S)
    for r in range(3):  # each repeat holds every pause once, starting one place on
        chunk = order[r * len(IDLE_GAPS_S) : (r + 1) * len(IDLE_GAPS_S)]
        assert sorted(chunk) == sorted(IDLE_GAPS_S) and chunk[0] == IDLE_GAPS_S[r]
    path = tmp_path / "idle.jsonl"
    layout = write_idle(str(path), 2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert layout[0] == LEAD and layout[1:] == idle_order(2) and len(rows) == len(layout)
    stamps = [r["timestamp"] / 1000 for r in rows]
    for gap, a, b in zip(layout[1:], stamps, stamps[1:]):
        assert b - a == pytest.approx(gap + 0.025, abs=1e-6)  # the pause after a served step
    assert all(r["input_length"] == PROBE_PROMPT and r["output_length"] == 2 for r in rows)


def _idle() -> dict:
    """A lead prompt, then pauses 0.02 / 1.0 / 0.02 / 1.0 s: the prefill
    engine idles 30 ms or 1.005 s before each step; the steps take 70, 80, 72
    and 84 ms."""
    layout = [LEAD, 0.02, 1.0, 0.02, 1.0]
    sent = [0.0, 0.1, 1.175, 1.285, 2.362]
    steps = [0.070, 0.070, 0.080, 0.072, 0.084]
    ids = ["i0", "i1", "i2", "i3", "i4"]
    rows = {rid: _row(t, step_s=s) for rid, t, s in zip(ids, sent, steps)}
    return {"layout": layout, "per_request": [[rid, [1.0]] for rid in ids], "rows": rows}


def test_the_steps_by_idle_time_are_made_non_decreasing():
    assert monotone([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert monotone([5.0, 1.0, 0.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert monotone([1.0, 2.0]) == [1.0, 2.0] and monotone([]) == []


def test_a_prompt_step_is_set_against_its_engines_own_idle_time():
    idle = _idle()
    got = p_steps(idle["rows"])
    assert got["i0"][3] != got["i0"][3]  # the engine's first step here: unknown (nan)
    assert [got[r][3] for r in ("i1", "i2", "i3", "i4")] == pytest.approx(
        [0.03, 1.005, 0.03, 1.005]
    )
    points = idle_points(idle)
    assert [(g, n) for g, _, _, n in points] == [(0.02, 2), (1.0, 2)]
    assert flat([[i, s] for _, i, s, _ in points]) == pytest.approx([0.03, 0.071, 1.005, 0.082])
    # the extra over back to back: 11 ms after a second idle; at a third of solo speed, a third
    assert flat(idle_extras(idle)) == pytest.approx([0.03, 0.0, 1.005, 0.011])
    assert flat(idle_extras(idle, rate=1 / 3)) == pytest.approx([0.03, 0.0, 1.005, 0.011 / 3])
    # two prompts computed in one step share its idle time; engines are apart
    rows = {"a": _row(0.0), "b": _row(0.5), "c": _row(0.5), "d": {**_row(0.6), "p_engine": "P2"}}
    got = p_steps(rows)
    assert got["b"][3] == got["c"][3] == pytest.approx(0.5 - 0.012)
    assert got["d"][3] != got["d"][3]


def test_the_lone_prompts_carry_the_idle_extra_so_the_overhead_is_taken_at_no_idle():
    p, probe, lone_step = probe_with_sweep()
    plain = service_figures(p.to_json(), probe)["service"]
    assert "prefill_after_idle_s" not in plain
    probe["idle"] = _idle()
    svc = service_figures(p.to_json(), probe)["service"]
    curve = svc["prefill_after_idle_s"]
    assert flat(curve) == pytest.approx([0.03, 0.0, 1.005, 0.011])
    lone_idle = lone_idle_s(probe)
    assert lone_idle == pytest.approx(1.0 - lone_step)
    at_lone = curve_at(curve, lone_idle)
    assert 0 < at_lone < 0.011
    # no idle: each lone and idle prompt's step less the curve at its idle time, the
    # median: lone 70 - at_lone twice (the first has no step before it), idle 70, 69, 72, 73
    base = (0.069 + 0.070) / 2
    assert base_step_s(probe, curve) == pytest.approx(base)
    assert svc["prefill_overhead_s"] == pytest.approx(
        plain["prefill_overhead_s"] - (lone_step - base)
    )
    served = Profile.from_json(service_figures(p.to_json(), probe))
    assert served.served_prefill_s(256, idle_s=0.0) == pytest.approx(base)
    assert served.served_prefill_s(256, idle_s=lone_idle) == pytest.approx(base + at_lone)
    # the beside prompts are set against that base at their own idle time
    at_beside = curve_at(curve, beside_idle_s(probe["sweep"]))
    assert flat(svc["prefill_beside_decode_s"]) == pytest.approx(
        flat(beside_extras(probe["sweep"], base + at_beside))
    )
    # the rounds' curves: point by point, the medians of idle times and extras
    other = json.loads(json.dumps(probe))
    other["idle"]["rows"]["i4"] = _row(2.362, step_s=0.094)  # 1 s: 16 ms over in this round
    got = median_figures(p.to_json(), [probe, other, probe], service_figures)["service"]
    assert flat(got["prefill_after_idle_s"]) == pytest.approx([0.03, 0.0, 1.005, 0.011])
    assert median_points([[[0.03, 0.0], [1.0, 0.01]], [[0.02, 0.0], [1.2, 0.02]],
                          [[0.04, 0.0], [1.1, 0.012]], [[0.5, 0.0]]]) == [  # fmt: skip
        [0.03, 0.0], [1.1, 0.012]
    ]  # fmt: skip


def test_the_traces_prompt_steps_are_grouped_by_their_engines_idle_time():
    p = profile()
    rows = {"a": _row(0.0, step_s=0.05), "b": _row(2.0, step_s=0.08)}
    [(idle, extra)] = trace_idle_rows(p, rows)
    assert idle == pytest.approx(2.0 - 0.05)
    assert extra == pytest.approx(0.08 - p.prefill_s(256))
    # b's step met a's stream (a decodes until 2.1 s): left out of the steps alone
    rows["a"]["end_s"], rows["b"]["end_s"] = 2.1, 2.2
    assert len(trace_idle_rows(p, rows)) == 1 and trace_idle_rows(p, rows, alone=True) == []
