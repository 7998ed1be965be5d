"""benchmarks/_sim_sweep.py: the served decode sweep's arithmetic (the step
overhead by batch, a prompt step's extra beside decoding streams) from known
numbers; no service."""

from __future__ import annotations

import json

import pytest

from benchmarks._sim_figures import host_figures, median_figures, service_figures
from benchmarks._sim_sweep import (
    BESIDE,
    PROBE_PROMPT,
    STREAM,
    SWEEP_GROUPS,
    SWEEP_OUTPUT,
    beside_extras,
    beside_steps,
    decode_overheads,
    median_curve,
    sweep_batches,
    sweep_itls,
    write_sweep,
)
from tandem.cluster.planner.profile import Profile
from tests.unit.test_sim_benchmark import _probe, _row
from tests.unit.test_simulator import profile

CONTEXT = PROBE_PROMPT + SWEEP_OUTPUT // 2


def flat(curve: list) -> list[float]:
    """A curve's pairs as one list (pytest.approx compares flat lists)."""
    return [v for pair in curve for v in pair]


def test_the_sweep_spans_the_traces_busy_moments_within_the_engines_limit():
    # 2 req/s x 72 tokens x 3 ms: 0.43 streams on average, 2.4 at a busy moment
    assert sweep_batches(2.0, 72, 32) == [1, 2, 4, 8]
    assert sweep_batches(0.1, 72, 32) == [1, 2, 4]  # at least up to 4
    assert sweep_batches(20.0, 72, 32) == [1, 2, 4, 8, 16, 32]  # 2 x 9.6: 32, the cap
    assert sweep_batches(2.0, 72, 3) == [1, 2]  # never past max_num_seqs


def test_the_sweep_trace_starts_each_group_together_with_a_prompt_beside(tmp_path):
    path = tmp_path / "sweep.jsonl"
    layout = write_sweep(str(path), [1, 4])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len(layout) == SWEEP_GROUPS * (1 + 1 + 4 + 1)
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps)
    assert all(r["input_length"] == PROBE_PROMPT for r in rows)
    for (_k, role), r in zip(layout, rows):
        assert r["output_length"] == (SWEEP_OUTPUT if role == STREAM else 2)
    fours = [r["timestamp"] for (k, role), r in zip(layout, rows) if k == 4 and role == STREAM]
    assert fours[:4] == [fours[0]] * 4  # a group of 4 streams sent at once
    assert sum(1 for k, role in layout if role == BESIDE) == 2 * SWEEP_GROUPS


def _sweep() -> dict:
    """Batch 1: a stream of 7 ms gaps; batch 2: two of 6 ms; beside prompts, two
    meeting the lone stream (74 and 76 ms steps), two meeting both streams of
    their group (80 and 82 ms), one meeting none (70 ms)."""
    layout = [[1, STREAM], [1, BESIDE], [1, BESIDE], [2, STREAM], [2, STREAM],
              [2, BESIDE], [2, BESIDE], [2, BESIDE]]  # fmt: skip
    per_request = [["s1", [7.0, 7.0, 7.2]], ["b1", [1.0]], ["b1'", [1.0]], ["s2", [6.0, 6.1]],
                   ["s3", [5.9, 6.0]], ["b2", [1.0]], ["b2'", [1.0]], ["b3", [1.0]]]  # fmt: skip
    rows = {}
    for rid, t0 in (("s1", 0.0), ("s2", 1.0), ("s3", 1.0)):
        rows[rid] = {**_row(t0), "end_s": t0 + 0.5}
    # a beside prompt's step, on the gateway's clock: first_token_s - finished_s + offsets
    for rid, t0, step in (("b1", 0.05, 0.074), ("b1'", 0.05, 0.076), ("b2", 1.05, 0.080),
                          ("b2'", 1.05, 0.082), ("b3", 2.0, 0.070)):  # fmt: skip
        rows[rid] = {**_row(t0, step_s=step), "end_s": t0 + 0.1}
    return {"layout": layout, "per_request": per_request, "rows": rows}


def probe_with_sweep(lone_step: float = 0.070) -> tuple[Profile, dict, float]:
    """The test profile and a probe with a sweep and three lone prompts whose prefill
    steps took ``lone_step``."""
    probe = _probe(30.0, 9.0)
    probe["sweep"] = _sweep()
    probe["stamps"] = [[f"l{i}", float(i), 0.006 + lone_step] for i in range(3)]
    probe["rows"] = {f"l{i}": _row(float(i), step_s=lone_step) for i in range(3)}
    return profile(), probe, lone_step


def test_the_overhead_is_each_batchs_served_itl_less_the_profiles_step():
    p = profile()
    sweep = _sweep()
    assert sweep_itls(sweep) == pytest.approx({1: 0.007, 2: 0.006})
    got = decode_overheads(p, sweep)
    assert flat(got) == pytest.approx(
        flat([[1, 0.007 - p.decode_s(1, CONTEXT)], [2, 0.006 - p.decode_s(2, 2 * CONTEXT)]])
    )
    # a batch whose served ITL is below the profile's step: 0, not negative
    assert decode_overheads(p, sweep, rate=0.1) == [[1, 0.0], [2, 0.0]]


def test_a_beside_prompt_is_set_against_the_streams_decoding_at_its_step():
    sweep = _sweep()
    steps = [1, 0.074, 1, 0.076, 2, 0.080, 2, 0.082, 0, 0.070]
    assert flat(beside_steps(sweep)) == pytest.approx(steps)
    # the lone probe's step 70 ms: +5 ms beside one stream, +11 beside two; none: left out
    assert flat(beside_extras(sweep, 0.070)) == pytest.approx([0, 0.0, 1, 0.005, 2, 0.011])
    assert flat(beside_extras(sweep, 0.090)) == pytest.approx([0, 0.0, 1, 0.0, 2, 0.0])
    # with the client's stamps a stream decodes from its second token: s3's came
    # after b2's steps (its handoff was still running), so they met one stream
    sweep["stamps"] = [["s2", 1.0, 0.01], ["s3", 1.0, 0.2]]
    steps[4] = steps[6] = 1
    assert flat(beside_steps(sweep)) == pytest.approx(steps)
    assert flat(beside_extras(sweep, 0.070)) == pytest.approx([0, 0.0, 1, 0.008])
    # a count only one prompt met is no point of the curve (one step on a shared box)
    del sweep["stamps"], sweep["rows"]["b2'"]
    assert flat(beside_extras(sweep, 0.070)) == pytest.approx([0, 0.0, 1, 0.005])


def test_a_probe_with_a_sweep_gives_the_profile_curves_and_their_medians():
    p, probe, lone_step = probe_with_sweep()
    svc = service_figures(p.to_json(), probe)["service"]
    over = decode_overheads(p, probe["sweep"])
    assert flat(svc["step_overhead_s"]) == pytest.approx(flat(over))
    # the lone prompt step's extra is taken over the batch-1 overhead
    assert svc["prefill_overhead_s"] == pytest.approx(lone_step - p.prefill_s(256) - over[0][1])
    assert flat(svc["prefill_beside_decode_s"]) == pytest.approx([0, 0.0, 1, 0.005, 2, 0.011])
    served = Profile.from_json(service_figures(p.to_json(), probe))
    assert served.served_prefill_s(256) == pytest.approx(lone_step)  # the lone probe's step
    assert served.served_prefill_s(256, decoding=2) == pytest.approx(lone_step + 0.011)
    host = host_figures({**p.to_json(), "host": {"cores": 2, "engine_threads": 1}}, probe, None)
    assert json.dumps(host["service"]) == json.dumps(svc)
    # three rounds' probes: each curve point the median of the probes that have it
    other = json.loads(json.dumps(probe))
    other["sweep"]["per_request"][0][1] = [9.0, 9.0]  # batch 1 slower in this round
    old = _probe(30.0, 9.0)  # a probe kept before the sweep: one number, its batch-1 figure
    got = median_figures(p.to_json(), [probe, other, old], service_figures)["service"]
    one = service_figures(p.to_json(), old)["service"]["step_overhead_s"]
    assert got["step_overhead_s"][0][1] == pytest.approx(
        sorted([over[0][1], 0.009 - p.decode_s(1, CONTEXT), one])[1]
    )
    assert median_curve([[[0, 0.0], [1, 0.004]], [[0, 0.0], [2, 0.01]], [[1, 0.006]]]) == [
        [0, 0.0], [1, 0.005], [2, 0.01]
    ]  # fmt: skip
