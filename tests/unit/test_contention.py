"""cluster/planner/contention.py: engines sharing a host's cores (processor
sharing), alone and inside the simulator. Known overlaps, known lengths."""

from __future__ import annotations

import copy
import json

import pytest

from tandem.cluster.planner.contention import CpuShare, HostShare
from tandem.cluster.planner.metrics import summarize
from tandem.cluster.planner.profile import load_profile, save_profile
from tandem.cluster.planner.simulator import SimRequest, Simulator
from tests.unit.test_simulator import _workload, profile


def _run(share: CpuShare, starts: dict[str, tuple[float, float, float]]) -> dict[str, float]:
    """Jobs ``key: (start_s, work_s, threads)`` on ``share``, event by event; their end times."""
    pending = sorted(starts.items(), key=lambda kv: kv[1][0])
    ends: dict[str, float] = {}
    while pending or share.jobs():
        running = share.jobs()
        next_end = min((share.finish_s(k) for k in running), default=float("inf"))
        next_start = pending[0][1][0] if pending else float("inf")
        t = min(next_end, next_start)
        share.advance(t)
        for k in running:
            if share.done(k):
                share.remove(k)
                ends[k] = t
        while pending and pending[0][1][0] <= t:
            key, (_, work, threads) = pending.pop(0)
            share.add(key, work, threads)
    return ends


def test_two_steps_on_one_core_each_take_twice_as_long():
    ends = _run(CpuShare(1), {"a": (0.0, 0.010, 1), "b": (0.0, 0.010, 1)})
    assert ends == pytest.approx({"a": 0.020, "b": 0.020})


def test_a_step_that_starts_half_way_shares_the_core_from_then_on():
    # a alone for 5 ms (5 left), then both at half speed: a ends at 15 ms having
    # given b 5 ms of work; b's last 5 ms run alone
    ends = _run(CpuShare(1), {"a": (0.0, 0.010, 1), "b": (0.005, 0.010, 1)})
    assert ends == pytest.approx({"a": 0.015, "b": 0.020})


def test_no_stretch_while_the_threads_fit_the_cores():
    ends = _run(CpuShare(2), {"a": (0.0, 0.010, 1), "b": (0.002, 0.004, 1)})
    assert ends == pytest.approx({"a": 0.010, "b": 0.006})


def test_three_engines_on_two_cores_run_at_two_thirds():
    jobs = {k: (0.0, 0.006, 1) for k in "abc"}
    assert _run(CpuShare(2), jobs) == pytest.approx({k: 0.009 for k in "abc"})


def test_threads_per_engine_and_the_background_count_in_the_demand():
    # two engines of two threads on two cores: demand 4, rate 1/2
    ends = _run(CpuShare(2), {"a": (0.0, 0.010, 2), "b": (0.0, 0.010, 2)})
    assert ends == pytest.approx({"a": 0.020, "b": 0.020})
    # one thread against 1.5 cores of other processes on two cores: rate 2 / 2.5
    assert _run(CpuShare(2, background=1.5), {"a": (0.0, 0.010, 1)}) == pytest.approx({"a": 0.0125})
    # a backlog that grows keeps its place: 3 ms + 2 ms more at 1 ms is 5 ms of work
    s = CpuShare(1)
    s.add("path", 0.003)
    s.advance(0.001)
    s.add("path", 0.002)
    assert s.finish_s("path") == pytest.approx(0.005)
    with pytest.raises(ValueError, match="time goes forward"):
        s.advance(0.0)


def _host(**kw) -> HostShare:
    return HostShare(**{"cores": 1, "engine_threads": 1, **kw})


def test_two_prefills_at_once_on_one_core_double_the_ttft():
    prompt = list(range(100, 400))
    w = [SimRequest(0.0, prompt, 2), SimRequest(0.0, [p + 1000 for p in prompt], 2)]
    p = profile()
    alone = Simulator(p, 2, 1).run(copy.deepcopy(w))
    assert [r.token_times[0] for r in alone] == pytest.approx([p.prefill_s(300)] * 2)
    p.host = _host(cores=2)  # a core each: as without the section
    two = Simulator(p, 2, 1).run(copy.deepcopy(w))
    assert [t for r in two for t in r.token_times] == pytest.approx(
        [t for r in alone for t in r.token_times]
    )
    p.host = _host(cores=1)
    one = Simulator(p, 2, 1).run(copy.deepcopy(w))
    assert [r.token_times[0] for r in one] == pytest.approx([2 * p.prefill_s(300)] * 2)


def test_the_serving_paths_cpu_per_token_competes_with_the_next_step():
    w = [SimRequest(0.0, list(range(300)), 5)]
    p = profile()
    [base] = Simulator(p, 1, 1).run(copy.deepcopy(w))
    per_token = 0.001  # under a decode step (5 ms), so it ends first
    p.host = _host(cores=1, cpu_per_token_s=per_token)
    [rec] = Simulator(p, 1, 1).run(copy.deepcopy(w))
    gaps = [b - a for a, b in zip(rec.token_times, rec.token_times[1:])]
    base_gaps = [b - a for a, b in zip(base.token_times, base.token_times[1:])]
    assert rec.token_times[0] == pytest.approx(base.token_times[0])
    # the first token's work runs alone during the handoff (3.2 ms > 1 ms): no delay
    assert gaps[0] == pytest.approx(base_gaps[0])
    # then each token's work shares the core with the next step for 2 x 1 ms: the
    # step ends 1 ms late (step + per-token work, all of it on one core)
    assert gaps[1:] == pytest.approx([g + per_token for g in base_gaps[1:]])
    p.host = _host(cores=2, cpu_per_token_s=per_token)  # a core of its own: no delay
    [free] = Simulator(p, 1, 1).run(copy.deepcopy(w))
    assert free.token_times == pytest.approx(base.token_times)


def test_contention_keeps_a_workload_deterministic_and_only_ever_slows_it():
    p = profile()
    base = summarize(Simulator(p, 2, 2).run(_workload(3)))
    p.host = _host(cores=2, cpu_per_token_s=0.0002, background_cores=0.5)
    a = summarize(Simulator(p, 2, 2).run(_workload(3)))
    b = summarize(Simulator(p, 2, 2).run(_workload(3)))
    assert a == b and a["num_completed"] == 120
    assert a["ttft_ms"]["p50"] > base["ttft_ms"]["p50"]
    assert a["itl_ms"]["p50"] > base["itl_ms"]["p50"]


def test_host_section_round_trips_and_bad_fields_are_named(tmp_path):
    p = profile()
    assert "host" not in p.to_json()  # a device per engine: the term is off
    p.host = _host(cores=2, cpu_per_token_s=0.0003)
    f = tmp_path / "p.json"
    save_profile(p, str(f))
    assert load_profile(str(f)).host == p.host
    for host, field in [
        ({"cores": 0}, "host.cores"),
        ({"cores": 2, "engine_threads": -1}, "host.engine_threads"),
        ({"cores": 2, "cpu_per_token_s": "x"}, "host.cpu_per_token_s"),
        ({"cores": 2, "background_cores": -0.1}, "host.background_cores"),
        ({"engine_threads": 1}, "host.cores"),
        ({"cores": 2, "gpus": 1}, "host.gpus"),
        ([2], "host"),
    ]:
        obj = p.to_json()
        obj["host"] = host
        f.write_text(json.dumps(obj))
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            load_profile(str(f))


def test_late_clocks_still_end_every_backlog():
    # at a day of simulated time the float spacing is ~1e-11 s: a backlog whose
    # last crumbs cannot move the clock ends instead of waking the loop forever
    p = profile()
    p.host = _host(cores=1, cpu_per_token_s=3e-7, background_cores=0.3)
    w = [SimRequest(86400.0 + i / 7, list(range(100 + i, 400 + i)), 9) for i in range(6)]
    recs = Simulator(p, 2, 2).run(w)
    assert all(len(r.token_times) == 9 for r in recs)
