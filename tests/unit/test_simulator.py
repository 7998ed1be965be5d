"""cluster/planner/simulator.py: the real schedulers on a virtual clock."""

from __future__ import annotations

import copy
import json

import pytest

from tandem.cluster.cli.main import main
from tandem.cluster.cli.trace_replay import SynthConfig, synthesize
from tandem.cluster.planner.metrics import summarize, ttft_parts
from tandem.cluster.planner.profile import Profile, TransferCost, interp, load_profile, save_profile
from tandem.cluster.planner.simulator import SimRequest, Simulator

SCHED = {
    "block_size": 16,
    "num_kv_blocks": 4096,
    "max_num_batched_tokens": 2048,
    "max_num_seqs": 64,
    "max_model_len": 8192,
}


def profile(**transfer) -> Profile:
    return Profile(
        prefill_tokens=[16, 1024, 4096],
        prefill_time_s=[0.01, 0.2, 0.9],
        decode_batch_sizes=[1, 64],
        decode_context_tokens=[16, 65536],
        decode_time_s=[[0.005, 0.008], [0.01, 0.03]],
        transfer=TransferCost(
            **{"bytes_per_s": 1e9, "latency_s": 0.002, "kv_bytes_per_token": 4096, **transfer}
        ),
        scheduler=dict(SCHED),
    )


def test_interpolation_is_piecewise_linear_and_extends_the_last_slope():
    xs, ys = [10, 20, 40], [1.0, 2.0, 4.0]
    assert interp(xs, ys, 5) == 1.0  # below the first point: the first value
    assert interp(xs, ys, 15) == pytest.approx(1.5)
    assert interp(xs, ys, 30) == pytest.approx(3.0)
    assert interp(xs, ys, 80) == pytest.approx(8.0)  # the last slope goes on
    p = profile()
    # bilinear on the decode grid: the middle of the square is the mean of its corners
    mid = p.decode_s(32.5, (16 + 65536) / 2)
    assert mid == pytest.approx((0.005 + 0.008 + 0.01 + 0.03) / 4)


def test_single_request_ttft_is_the_prefill_and_the_handoff_delays_the_second_token():
    p = profile()
    prompt = list(range(100, 400))  # 300 tokens
    [rec] = Simulator(p, 1, 1).run([SimRequest(0.5, prompt, 4)])
    # P's sampled token is the first token, streamed at once (cluster/disagg/orchestration.py)
    assert rec.token_times[0] - rec.arrival_s == pytest.approx(p.prefill_s(300))
    # D takes prompt + first token, reads the prompt's 300 tokens and computes the 301st
    assert p.handoff_s(300) == pytest.approx(0.002 + 300 * 4096 / 1e9)
    itls = [b - a for a, b in zip(rec.token_times, rec.token_times[1:])]
    assert itls == pytest.approx(
        [p.handoff_s(300) + p.decode_s(1, 301), p.decode_s(1, 302), p.decode_s(1, 303)]
    )
    assert len(rec.token_times) == 4


def test_a_one_token_request_is_computed_whole_on_a_decode_engine():
    p = profile()
    [rec] = Simulator(p, 1, 1).run([SimRequest(0.0, list(range(200)), 1)])
    assert rec.token_times == pytest.approx([p.prefill_s(200)])  # no handoff


def _workload(seed: int, n: int = 120) -> list[SimRequest]:
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(6.0)
        out.append(
            SimRequest(
                t, [rng.randrange(500) for _ in range(rng.randint(50, 900))], rng.randint(5, 120)
            )
        )
    return out


def test_same_workload_same_result_and_nothing_leaks():
    a = summarize(Simulator(profile(), 2, 2).run(_workload(3)), 400, 20)
    b = summarize(Simulator(profile(), 2, 2).run(_workload(3)), 400, 20)
    assert a == b
    assert a["num_completed"] == 120
    # run() ends with check_integrity() on every scheduler: no block or request left


def test_more_prefill_engines_shorten_the_prompt_queue():
    w = _workload(1, 200)
    one = summarize(Simulator(profile(), 1, 1).run(copy.deepcopy(w)))
    two = summarize(Simulator(profile(), 2, 1).run(copy.deepcopy(w)))
    assert two["ttft_ms"]["p90"] < one["ttft_ms"]["p90"]


def test_a_slow_handoff_delays_the_second_token_and_holds_prefill_blocks_until_read():
    w = [SimRequest(0.0, list(range(1000)), 3)]
    fast = Simulator(profile(), 1, 1).run(copy.deepcopy(w))[0]
    slow = Simulator(profile(bytes_per_s=1e6), 1, 1).run(copy.deepcopy(w))[0]
    assert slow.token_times[0] == fast.token_times[0]  # P's token does not wait for the read
    assert (slow.token_times[1] - fast.token_times[1]) == pytest.approx(1000 * 4096 * (1e-6 - 1e-9))


def test_a_prompt_longer_than_the_model_fails_that_request_only():
    w = [SimRequest(0.0, [1] * 9000, 3), SimRequest(0.0, [2] * 20, 3)]
    recs = Simulator(profile(), 1, 1).run(w)
    assert "max_model_len" in recs[0].error and not recs[1].error
    s = summarize(recs)
    assert (s["num_completed"], s["num_failed"]) == (1, 1)


def test_goodput_counts_requests_meeting_both_slos():
    recs = Simulator(profile(), 1, 1).run([SimRequest(0.0, [1] * 100, 5)])
    ttft_ms = (recs[0].token_times[0] - recs[0].arrival_s) * 1000
    assert summarize(recs, ttft_ms + 1, 100)["num_good"] == 1
    assert summarize(recs, ttft_ms - 1, 100)["num_good"] == 0
    assert summarize(recs, ttft_ms + 1, 1)["num_good"] == 0


def test_bad_profiles_name_the_field(tmp_path):
    good = profile().to_json()
    for path, value, field in [
        (("prefill", "time_s"), [0.1], "prefill.time_s"),
        (("decode", "batch_sizes"), [4, 1], "decode.batch_sizes"),
        (("transfer", "bytes_per_s"), 0, "transfer.bytes_per_s"),
    ]:
        bad = copy.deepcopy(good)
        bad[path[0]][path[1]] = value
        f = tmp_path / "p.json"
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            load_profile(str(f))
    f = tmp_path / "p.json"
    save_profile(profile(), str(f))
    assert load_profile(str(f)).to_json() == good


# ---- CLI ---------------------------------------------------------------------------


@pytest.fixture
def profile_file(tmp_path):
    f = tmp_path / "profile.json"
    save_profile(profile(), str(f))
    return str(f)


def test_simulate_without_profile_names_the_flag(capsys):
    assert main(["simulate", "--prefill", "1", "--decode", "1"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_simulate_bad_input_names_the_flag(capsys, profile_file, tmp_path):
    assert main(["simulate", "--profile", str(tmp_path / "none.json")]) == 2
    assert "--profile" in capsys.readouterr().err
    assert main(["simulate", "--profile", profile_file, "--decode", "0"]) == 2
    assert "--decode" in capsys.readouterr().err
    assert main(["simulate", "--profile", profile_file, "--itl-slo-ms", "-1"]) == 2
    assert "--itl-slo-ms" in capsys.readouterr().err
    assert main(["simulate", "--profile", profile_file, "--trace", str(tmp_path / "x.jsonl")]) == 2
    assert "x.jsonl" in capsys.readouterr().err


def test_plan_requires_slos_and_engines(capsys, profile_file):
    assert main(["plan", "--profile", profile_file, "--itl-slo-ms", "20"]) == 2
    assert "--ttft-slo-ms" in capsys.readouterr().err
    args = ["plan", "--profile", profile_file, "--ttft-slo-ms", "300", "--itl-slo-ms", "20"]
    assert main([*args, "--max-engines", "1"]) == 2
    assert "--max-engines" in capsys.readouterr().err
    assert main(["plan", "--ttft-slo-ms", "300", "--itl-slo-ms", "20"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_simulate_a_mooncake_trace_twice_gives_the_same_json(capsys, profile_file, tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = synthesize(SynthConfig(num_sessions=6, session_rate_per_s=2.0, seed=4))
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "simulate",
        "--profile",
        profile_file,
        "--trace",
        str(trace),
        "--prefill",
        "2",
        "--decode",
        "1",
        "--trace-block-tokens",
        "64",
        "--ttft-slo-ms",
        "500",
        "--itl-slo-ms",
        "20",
        "--json",
    ]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert first["num_completed"] == len(rows)


def test_simulate_an_azure_trace(capsys, profile_file, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:46.9805900,120,10\n"
    )
    assert main(["simulate", "--profile", profile_file, "--trace", str(trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_completed"] == 2


def test_plan_searches_every_split(capsys, profile_file):
    args = [
        "plan",
        "--profile",
        profile_file,
        "--ttft-slo-ms",
        "300",
        "--itl-slo-ms",
        "20",
        "--max-engines",
        "3",
        "--num-requests",
        "60",
        "--request-rate",
        "5",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted((r["prefill"], r["decode"]) for r in out["splits"]) == [(1, 1), (1, 2), (2, 1)]
    best = max(r["goodput_per_engine"] for r in out["splits"])
    assert out["best"]["goodput_per_engine"] == best
    model = out["sla_model"]
    assert model["prefill"] >= 1 and model["decode"] >= 1
    assert model["output_tokens"] > 0 and model["rate"] > 0


def test_decode_extrapolation_adds_the_axes_slopes_without_a_cross_term():
    p = profile()  # corners: (1,16) 0.005, (1,65536) 0.008, (64,16) 0.01, (64,65536) 0.03
    slope_b = (0.03 - 0.008) / 63  # per request, at the context edge
    slope_c = (0.03 - 0.01) / (65536 - 16)  # per context token, at the batch edge
    got = p.decode_s(128, 131072)
    assert got == pytest.approx(0.03 + 64 * slope_b + (131072 - 65536) * slope_c)
    assert p.decode_s(0.5, 1) == pytest.approx(0.005)  # below the grid: its corner


def test_the_seed_picks_the_synthetic_workload(capsys, profile_file):
    def run(seed):
        args = ["simulate", "--profile", profile_file, "--num-requests", "40", "--seed", seed]
        assert main([*args, "--range-ratio", "0.5", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    assert run("1") == run("1")
    assert run("1")["ttft_ms"] != run("2")["ttft_ms"]


# ---- tensor parallelism per pool -----------------------------------------------------


def tp2_profile() -> Profile:
    """A TP-2 engine: two devices, prefill 1.8x and decode 1.4x as fast, twice the KV."""
    base = profile(bytes_per_s=2e9)
    return Profile(
        prefill_tokens=base.prefill_tokens,
        prefill_time_s=[t / 1.8 for t in base.prefill_time_s],
        decode_batch_sizes=base.decode_batch_sizes,
        decode_context_tokens=base.decode_context_tokens,
        decode_time_s=[[t / 1.4 for t in row] for row in base.decode_time_s],
        transfer=base.transfer,
        scheduler={**SCHED, "num_kv_blocks": 2 * SCHED["num_kv_blocks"]},
        meta={"model": "m", "tensor_parallel_size": 2},
    )


def test_each_pool_steps_and_reads_at_its_own_profile():
    p1, p2 = profile(), tp2_profile()
    [rec] = Simulator(p1, 1, 1, decode_profile=p2).run([SimRequest(0.0, list(range(300)), 3)])
    gaps = [b - a for a, b in zip(rec.token_times, rec.token_times[1:])]
    assert rec.token_times[0] == pytest.approx(p1.prefill_s(300))  # the prefill pool's
    assert gaps == pytest.approx([p2.handoff_s(300) + p2.decode_s(1, 301), p2.decode_s(1, 302)])
    assert p2.handoff_s(300) != p1.handoff_s(300)


def test_plan_candidates_bound_engines_and_devices():
    from tandem.cluster.cli.simulate import plan_candidates

    assert plan_candidates([1], 3, None) == [(1, 1, 1, 1), (1, 1, 1, 2), (1, 2, 1, 1)]
    got = plan_candidates([1, 2], 3, 4)
    assert all(p + d <= 3 and p * tp + d * dtp <= 4 for tp, p, dtp, d in got)
    assert (2, 1, 2, 1) in got and (2, 1, 1, 2) in got and (1, 2, 2, 1) in got
    assert (2, 2, 1, 1) not in got and (2, 1, 2, 2) not in got  # 5 and 6 devices


def test_plan_searches_the_tp_size_of_each_pool(capsys, profile_file, tmp_path):
    tp2_file = tmp_path / "tp2.json"
    save_profile(tp2_profile(), str(tp2_file))
    args = ["plan", "--profile", profile_file, "--profile", str(tp2_file)]
    args += ["--ttft-slo-ms", "300", "--itl-slo-ms", "20", "--max-engines", "3"]
    args += ["--max-devices", "4", "--num-requests", "60", "--request-rate", "5", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    from tandem.cluster.cli.simulate import plan_candidates

    searched = sorted(
        (r["prefill_tp"], r["prefill"], r["decode_tp"], r["decode"]) for r in out["splits"]
    )
    assert searched == sorted(plan_candidates([1, 2], 3, 4))
    for r in out["splits"]:
        assert r["devices"] == r["prefill"] * r["prefill_tp"] + r["decode"] * r["decode_tp"]
        assert r["goodput_per_device"] == pytest.approx(r["goodput"] / r["devices"])
    assert out["best"]["goodput_per_device"] == max(r["goodput_per_device"] for r in out["splits"])
    # a TP-2 pool is faster than a TP-1 pool of the same engine count
    by = {(r["prefill_tp"], r["prefill"], r["decode_tp"], r["decode"]): r for r in out["splits"]}
    assert by[(2, 1, 2, 1)]["ttft_ms"]["p90"] < by[(1, 1, 1, 1)]["ttft_ms"]["p90"]
    # the table names each pool's TP size
    assert main([a for a in args if a != "--json"]) == 0
    assert "1P(tp2)1D(tp2)" in capsys.readouterr().out


def test_tp_profiles_bad_input_names_the_flag(capsys, profile_file, tmp_path):
    plan = ["plan", "--ttft-slo-ms", "300", "--itl-slo-ms", "20"]
    assert main([*plan, "--profile", profile_file, "--profile", profile_file]) == 2
    assert "tensor_parallel_size 1" in capsys.readouterr().err
    assert main([*plan, "--profile", profile_file, "--max-devices", "1"]) == 2
    assert "--max-devices" in capsys.readouterr().err
    tp4 = tmp_path / "tp4.json"
    save_profile(
        Profile(**{**tp2_profile().__dict__, "meta": {"tensor_parallel_size": 4}}), str(tp4)
    )
    assert main([*plan, "--profile", str(tp4), "--max-devices", "7"]) == 2
    assert "no split fits" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    obj = tp2_profile().to_json()
    obj["tensor_parallel_size"] = 0
    bad.write_text(json.dumps(obj))
    assert main([*plan, "--profile", str(bad)]) == 2
    assert "tensor_parallel_size" in capsys.readouterr().err
    sim = ["simulate", "--profile", profile_file, "--decode-profile", str(tmp_path / "no.json")]
    assert main(sim) == 2
    assert "--decode-profile" in capsys.readouterr().err


def test_service_figures_add_the_path_latency_once_and_the_loop_overhead_per_step(tmp_path):
    p = profile()
    p.request_latency_s, p.step_overhead_s = 0.004, 0.0005
    [rec] = Simulator(p, 1, 1).run([SimRequest(1.0, list(range(300)), 3)])
    assert rec.token_times[0] - rec.arrival_s == pytest.approx(0.004 + p.prefill_s(300) + 0.0005)
    gaps = [b - a for a, b in zip(rec.token_times, rec.token_times[1:])]
    assert gaps == pytest.approx(
        [p.handoff_s(300) + p.decode_s(1, 301) + 0.0005, p.decode_s(1, 302) + 0.0005]
    )
    f = tmp_path / "p.json"
    save_profile(p, str(f))
    assert load_profile(str(f)).to_json()["service"] == {
        "request_latency_s": 0.004,
        "step_overhead_s": 0.0005,
        "prefill_overhead_s": 0.0,
    }
    obj = p.to_json()
    obj["service"]["step_overhead_s"] = -1
    f.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"service\.step_overhead_s"):
        load_profile(str(f))
    obj["service"] = {"prefill_overhead_s": "2 ms"}
    f.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"service\.prefill_overhead_s"):
        load_profile(str(f))
    assert "service" not in profile().to_json()  # engine-only profiles stay as they were


def test_prefill_overhead_lengthens_prompt_steps_only_and_the_ttft_parts_add_up():
    p = profile()
    p.request_latency_s, p.step_overhead_s, p.prefill_overhead_s = 0.004, 0.0005, 0.003
    reqs = [SimRequest(1.0, list(range(300)), 3), SimRequest(1.001, list(range(1000, 1200)), 2)]
    sim = Simulator(p, 1, 1)
    first, second = sim.run(reqs)
    step = p.prefill_s(300) + 0.0005 + 0.003  # Profile.served_prefill_s
    assert step == pytest.approx(p.served_prefill_s(300))
    assert first.token_times[0] - first.arrival_s == pytest.approx(0.004 + step)
    gaps = [b - a for a, b in zip(first.token_times, first.token_times[1:])]
    assert gaps == pytest.approx(  # decode steps carry the loop's overhead, not the prefill's
        [p.handoff_s(300) + p.decode_s(1, 301) + 0.0005, p.decode_s(1, 302) + 0.0005]
    )
    # the second prompt arrives while the first computes: it waits for that step
    assert second.entry_s == pytest.approx(1.005)
    assert second.first_step_s == pytest.approx(1.004 + step)
    assert second.token_times[0] - second.first_step_s == pytest.approx(p.served_prefill_s(200))
    parts = ttft_parts([first, second])
    assert parts["path"] == pytest.approx(4.0)
    assert parts["queue"] == pytest.approx((step - 0.001) * 1000 / 2)
    assert parts["step"] == pytest.approx((step + p.served_prefill_s(200)) * 1000 / 2)
    assert parts["ttft"] == pytest.approx(parts["path"] + parts["queue"] + parts["step"])
