"""The sla planner's watch between rounds (cluster/planner/watch.py,
``SlaPlanner.watch``, the runner's and the simulator's use of it): a measured
breach re-plans at once, with counts checked by hand; no breach, or a re-plan
that changes nothing, decides nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math

import pytest

from tandem.cluster.planner import watch
from tandem.cluster.planner.autoscale import (
    HOLD,
    SCALE_OUT,
    Decision,
    EngineSample,
    LoadPlanner,
    Observation,
    ScaledProfile,
    SlaPlanner,
    prefill_speed,
)
from tandem.cluster.planner.runner import PlannerRunner
from tandem.cluster.planner.sla import Load, required
from tests.unit.test_planner_autoscale import BOUNDS, INTERVAL, LOAD_CONFIG, sla_config
from tests.unit.test_sla_planner import profile as flat_profile


def profile():
    """test_sla_planner's profile, but a prefill of x tokens takes x * 0.1 ms
    (0.0001 s at 1 token, 1.0001 s at 10001: linear in between and past)."""
    return dataclasses.replace(
        flat_profile(), prefill_tokens=[1, 10001], prefill_time_s=[0.0001, 1.0001]
    )


def prefill(waiting: list[int], ready: bool = True) -> list[EngineSample]:
    return [EngineSample(f"prefill-{i}", ready, waiting=w) for i, w in enumerate(waiting)]


def decode(n: int, **kw) -> list[EngineSample]:
    return [EngineSample(f"decode-{i}", True, **kw) for i in range(n)]


def counters(arrivals: int, prompt: int = 1000, output: int = 100, finished: int | None = None):
    done = arrivals if finished is None else finished
    return dict(
        arrivals=arrivals,
        prompt_tokens=arrivals * prompt,
        finished=done,
        output_tokens=done * output,
        requested_output_tokens=arrivals * output,
    )


def test_prefill_breach_is_the_queued_prompts_wait_at_the_profiles_speed():
    win = watch.Window(2.0, 20, 10.0, 1000.0, 100.0)
    # 4 and 2 waiting on two ready engines: 3 per engine; the next prompt waits
    # for them and its own: (3 + 1) x 1000 tokens x 0.1 ms = 0.4 s > 0.3 s
    obs = Observation(12.0, {"prefill": prefill([4, 2])})
    b = watch.prefill_breach(obs, win, profile(), ttft_slo_ms=300.0)
    assert b is not None and (b.pool, b.reason) == ("prefill", "ttft_breach")
    assert b.inputs["queued_per_engine"] == 3.0
    assert b.inputs["measured_ttft_ms"] == pytest.approx(400.0)
    # 1 per engine: (1 + 1) x 1000 x 0.1 ms = 0.2 s, within the SLO
    assert watch.prefill_breach(Observation(12.0, {"prefill": prefill([1, 1])}), win,
                                profile(), 300.0) is None  # fmt: skip
    # an engine still starting is not measured (its queue is the router's choice)
    starting = prefill([4, 2]) + prefill([0], ready=False)
    assert watch.prefill_breach(Observation(12.0, {"prefill": starting}), win, profile(), 300.0)
    assert watch.prefill_breach(Observation(12.0, {"prefill": []}), win, profile(), 300.0) is None


def test_decode_breach_is_the_warm_engines_median_step():
    warm = dict(running=8, num_steps=40)
    engines = [
        EngineSample("decode-0", True, last_step_s=0.06, **warm),
        EngineSample("decode-1", True, last_step_s=0.07, **warm),
        EngineSample("decode-2", True, last_step_s=0.02, **warm),
        # a cold engine's steps are not its speed: 0.5 s ignored
        EngineSample("decode-3", True, running=8, num_steps=5, last_step_s=0.5),
    ]
    b = watch.decode_breach(Observation(0.0, {"decode": engines}), 32, itl_slo_ms=50.0)
    assert b is not None and b.reason == "itl_breach"
    assert b.inputs["measured_itl_ms"] == pytest.approx(60.0)  # median of 20, 60, 70
    fine = [dataclasses.replace(e, last_step_s=0.04) for e in engines[:3]]
    assert watch.decode_breach(Observation(0.0, {"decode": fine}), 32, 50.0) is None
    idle = [dataclasses.replace(e, running=0) for e in engines]  # no running request waits
    assert watch.decode_breach(Observation(0.0, {"decode": idle}), 32, 50.0) is None


def test_window_load_is_the_arrivals_since_the_round_plus_the_queue_over_an_interval():
    last = Observation(10.0, {}, **counters(50))
    now = Observation(12.0, {"prefill": prefill([6, 4])}, **counters(70))
    # the 20 requests of the window: 2000-token prompts, 30 tokens asked for
    now = dataclasses.replace(now, prompt_tokens=50 * 1000 + 20 * 2000,
                              requested_output_tokens=50 * 100 + 20 * 30)  # fmt: skip
    win = watch.window(last, now, Load(5.0, 1000.0, 100.0))
    assert (win.seconds, win.arrivals, win.rate) == (2.0, 20, 10.0)
    assert (win.prompt_tokens, win.output_tokens) == (2000.0, 30.0)
    # 10 queued, drained over one 10 s interval: 1 request/s on top of the 10
    assert watch.window_load(now, win, 10.0) == Load(11.0, 2000.0, 30.0)
    # no arrivals in the window: the prediction's lengths; no time: no window
    quiet = watch.window(last, dataclasses.replace(last, time_s=11.0), Load(5.0, 1000.0, 100.0))
    assert (quiet.rate, quiet.prompt_tokens, quiet.output_tokens) == (0.0, 1000.0, 100.0)
    assert watch.window(last, last, Load(5.0, 1000.0, 100.0)) is None


def ttft_p90(rate: float, n: int, s: float = 0.1) -> float:
    """test_sla_planner's M/M/1 arithmetic: wait p90 + the prefill."""
    rho = rate * s / n
    return (s * math.log(10 * rho) / (1 - rho) if rho > 0.1 else 0.0) + s


def test_a_measured_breach_replans_both_pools_at_once():
    planner = SlaPlanner(sla_config(), BOUNDS, profile())
    assert planner.watch(Observation(0.0, {"prefill": prefill([9]), "decode": decode(1)})) == []
    planner.decide(Observation(0.0, {"prefill": prefill([0]), "decode": decode(2)}))  # baseline
    # a round: 5 req/s of 1000-token prompts (0.1 s each) and 100-token answers.
    # prefill: rho = 0.5 / N; N = 1 gives 0.42 s > 0.3, N = 2 gives 0.22 s.
    # decode: itl = 0.01 + 0.001 c, c = 500 / N x itl: N = 1 gives 20 ms, so 2 -> 1
    assert ttft_p90(5.0, 1) > 0.3 >= ttft_p90(5.0, 2)
    obs = Observation(INTERVAL, {"prefill": prefill([0]), "decode": decode(2)}, **counters(50))
    sizes = {d.pool: d.target for d in planner.decide(obs)}
    assert sizes == {"prefill": 2, "decode": 1}
    # between rounds, no breach: nothing decided (not even a hold)
    calm = Observation(11.0, {"prefill": prefill([1, 1]), "decode": decode(1)}, **counters(60))
    assert planner.watch(calm) == []
    # 2 s after the round: 20 arrivals (10/s) and 5 queued per engine: the next
    # prompt waits (5 + 1) x 0.1 s = 0.6 s > 0.3 s. Re-plan for 10 + 10 queued
    # / 10 s = 11 req/s: prefill N = 3 gives 0.305 s, N = 4 gives 0.240 s;
    # decode k = 1100 / N: N = 1 has no fixed point, N = 2 gives c = 12.2, 22 ms
    breach = Observation(12.0, {"prefill": prefill([5, 5]), "decode": decode(1)}, **counters(70))
    decisions = planner.watch(breach)
    assert ttft_p90(11.0, 3) > 0.3 >= ttft_p90(11.0, 4)
    pre, dec = required(Load(11.0, 1000, 100), profile(), 300.0, 50.0, (1, 1), (16, 16))
    assert (pre.engines, dec.engines) == (4, 2)
    assert [(d.pool, d.action, d.reason, d.current, d.target) for d in decisions] == [
        ("prefill", SCALE_OUT, "ttft_breach", 2, 4),
        ("decode", SCALE_OUT, "itl_slo", 1, 2),  # the window's load needs it too
    ]
    inputs = decisions[0].inputs
    assert inputs["rate_per_s"] == pytest.approx(11.0) and inputs["window_s"] == 2.0
    assert inputs["measured_ttft_ms"] == pytest.approx(600.0)
    assert inputs["queued_per_engine"] == 5.0
    assert inputs["predicted_p90_ms"] == pytest.approx(ttft_p90(11.0, 4) * 1000)
    # a second look while the new engines start: the same plan, nothing new
    starting = prefill([5, 5]) + [EngineSample(f"prefill-{i}", False) for i in (2, 3)]
    again = Observation(13.0, {"prefill": starting, "decode": decode(2)}, **counters(80))
    assert planner.watch(again) == []


def test_the_runner_applies_a_watchs_decisions_and_only_an_sla_planner_watches():
    d = Decision("prefill", SCALE_OUT, "ttft_breach", 1, 3, {"measured_ttft_ms": 900.0})
    hold = Decision("decode", HOLD, "itl_slo_met", 1, 1)

    class Planner:
        def decide(self, obs):
            return [hold]

        def watch(self, obs):
            return [d, hold]

    calls, recorded = [], []

    async def scale(role: str, n: int) -> dict:
        calls.append((role, n))
        return {}

    runner = PlannerRunner(Planner(), lambda: Observation(0.0, {}), scale, recorded.append,
                           10.0, 1.0)  # fmt: skip
    assert runner.watch_interval_s == 1.0
    assert asyncio.run(runner.watch_step()) == [d, hold]
    assert recorded == [d, hold] and calls == [("prefill", 3)]
    load = PlannerRunner(LoadPlanner(LOAD_CONFIG, {"decode": (1, 2)}), lambda: None, scale,
                         recorded.append, 10.0, 1.0)  # fmt: skip
    assert load.watch_interval_s == 0.0  # load has no watch: rounds only


def test_watch_interval_names_the_field():
    with pytest.raises(ValueError, match="planner-watch-interval-s"):
        sla_config(planner_watch_interval_s=-1.0)


def test_in_the_simulator_the_watch_moves_engines_before_the_next_round():
    """cluster/planner/elastic.py with the watch: test_planner_autoscale's
    shifting mix (decode-heavy, then long prompts at t = 60 s), but after the
    shift 6 req/s of 0.2 s prompts overload the one prefill engine (rho 1.2);
    rounds every 5 s. With the watch, prefill grows on a measured TTFT breach
    before the first round that could see the shift; the run is deterministic."""
    import random

    from tandem.cluster.planner.elastic import ElasticSimulator
    from tandem.cluster.planner.simulator import SimRequest

    rng = random.Random(0)
    requests, t = [], 0.0
    while t < 120.0:
        t += rng.expovariate(4.0 if t < 60 else 6.0)
        prompt, out = (64, 200) if t < 60 else (2000, 4)
        requests.append(SimRequest(t, [rng.randrange(3, 30000) for _ in range(prompt)], out))
    prof = dataclasses.replace(
        profile(),
        scheduler={"block_size": 16, "num_kv_blocks": 4096, "max_num_batched_tokens": 2048,
                   "max_num_seqs": 64, "max_model_len": 4096},
    )  # fmt: skip

    def run(watch_s: float):
        bounds = {"prefill": (1, 3), "decode": (1, 3)}
        config = sla_config(planner_scale_in_cooldown_s=10.0, planner_watch_interval_s=watch_s)
        planner = SlaPlanner(config, bounds, prof)
        sim = ElasticSimulator(prof, 1, 3, planner, interval_s=5.0, cold_start_s=5.0, slots=4,
                               watch_interval_s=watch_s)  # fmt: skip
        records = sim.run(requests)  # check_integrity() on every engine inside
        return sim, [r.token_times for r in records]

    def first_growth(sim) -> float:
        return min(t for t, p, _ in sim.sizes if t > 60.0 and p > 1)

    rounds, _ = run(0.0)
    watched, times = run(1.0)
    assert all(p + d <= 4 for _, p, d in watched.sizes), watched.sizes
    early = [d for d in watched.decisions if d.reason == "ttft_breach"]
    assert early and all("window_s" in d.inputs for d in early)
    # rounds only: the round at 65 s; the watch: 62 s (a breach, 2 s in)
    assert first_growth(watched) < first_growth(rounds), (watched.sizes, rounds.sizes)
    assert run(1.0)[1] == times  # the same workload gives the same result


def test_the_runner_with_a_watch_takes_its_baseline_at_once_then_watches():
    """run(): the first call is a round (sla's baseline) at the start, the
    next ones, an hour before the next round is due, are watches."""
    calls: list[str] = []

    async def main():
        done = asyncio.Event()

        class Planner:
            def decide(self, obs):
                calls.append("decide")
                return []

            def watch(self, obs):
                calls.append("watch")
                if calls.count("watch") >= 3:
                    done.set()
                return []

        async def scale(role: str, n: int) -> dict:
            return {}

        runner = PlannerRunner(Planner(), lambda: Observation(0.0, {}), scale, calls.append,
                               3600.0, 0.001)  # fmt: skip
        task = asyncio.create_task(runner.run())
        try:
            await asyncio.wait_for(done.wait(), 30.0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert calls[:4] == ["decide", "watch", "watch", "watch"], calls


def test_prefill_steps_correct_the_profiles_prefill_speed():
    """The observed/predicted ratio for prefill: a warm prefill engine's latest
    step against the profile's time for the tokens it computed."""
    speed = prefill_speed(profile(), warmup_steps=32)

    def engine(steps: int, tokens: int, step_s: float, i: int = 0) -> EngineSample:
        return EngineSample(f"prefill-{i}", True, 1, num_steps=steps, last_step_s=step_s,
                            last_step_tokens=tokens)  # fmt: skip

    for steps in (0, 10, 31, 40):  # cold steps, 50x slow: not its speed
        assert speed.observe([engine(steps, 2000, 10.0)]) == 1.0
    assert speed.observe([engine(45, 0, 0.5)]) == 1.0  # computed nothing: says nothing
    # warm, 0.4 s for 2000 tokens where the profile says 0.2 s: a ratio of 2,
    # smoothed by half each time: 1.5, 1.75
    assert speed.observe([engine(50, 2000, 0.4)]) == pytest.approx(1.5)
    assert speed.observe([engine(60, 2000, 0.4)]) == pytest.approx(1.75)
    # the planner's prefill count follows: 5 req/s of 1000-token prompts needs
    # 2 engines at the profile's speed (test above) and, with every prompt
    # taking ~0.2 s (factor 2 - 2^-6 after six rounds), N = 6 gives
    # rho = 0.165, 0.318 s > 0.3 and N = 7 gives rho = 0.142, 0.279 s
    planner = SlaPlanner(sla_config(), BOUNDS, profile())
    sizes = {"prefill": 1, "decode": 1}
    for k in range(7):
        pools = {"prefill": [engine(40 + 10 * k, 2000, 0.4, i) for i in range(sizes["prefill"])],
                 "decode": decode(sizes["decode"])}  # fmt: skip
        for d in planner.decide(Observation(k * INTERVAL, pools, **counters(50 * k))):
            sizes[d.pool] = d.target
    factor = planner.prefill_speed.factor
    assert factor == pytest.approx(2 - 2**-6)
    slow = ScaledProfile(profile(), 1.0, factor)
    pre, _ = required(Load(5.0, 1000, 100), slow, 300.0, 50.0, (1, 1), (16, 16))
    assert sizes["prefill"] == pre.engines == 7
    assert d.inputs["prefill_speed_factor"] == pytest.approx(factor)


def test_a_breaching_pool_never_shrinks_in_a_watch():
    """Arrivals stop while a queue drains: the window's load alone would need
    one prefill engine, but the pool misses its SLO now, so it holds."""
    planner = SlaPlanner(sla_config(planner_scale_in_cooldown_s=0.0), BOUNDS, profile())
    planner.decide(Observation(0.0, {"prefill": prefill([0]), "decode": decode(1)}))
    planner.decide(Observation(INTERVAL, {"prefill": prefill([0, 0]), "decode": decode(1)},
                               **counters(50)))  # fmt: skip
    # 2 s on, no arrivals, 3 queued on each of 4 engines: (3 + 1) x 0.1 s =
    # 0.4 s > 0.3 s; the window's load is 0 + 12 / 10 = 1.2 req/s, for which
    # one engine gives rho 0.12 and 0.121 s
    assert ttft_p90(1.2, 1) <= 0.3
    draining = Observation(12.0, {"prefill": prefill([3, 3, 3, 3]), "decode": decode(1)},
                           **counters(50))  # fmt: skip
    assert planner.watch(draining) == []
    pre, _ = required(Load(1.2, 1000, 100), profile(), 300.0, 50.0, (1, 1), (16, 16))
    assert pre.engines == 1  # what the window alone would have asked for
