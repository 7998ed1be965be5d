"""The running planner's decisions (cluster/planner/autoscale.py, runner.py)
against a fake clock and synthetic figures: a load ramp scales out and back
in after the cooldown; zero traffic (no figures at all) goes to the minimum
instead of freezing; steady load at the edge does not oscillate; an
engine's cold-start steps do not count as its speed; the sla planner's
counts are the SLA arithmetic's; the runner resizes only on a change."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tandem.cluster.planner.autoscale import (
    HOLD,
    SCALE_IN,
    SCALE_OUT,
    EngineSample,
    LoadPlanner,
    Observation,
    SlaPlanner,
    SpeedCorrection,
)
from tandem.cluster.planner.config import PlannerConfig
from tandem.cluster.planner.runner import PlannerRunner
from tandem.cluster.planner.sla import Load, required
from tests.unit.test_sla_planner import (
    profile,  # the profile whose arithmetic is checked by hand there
)

INTERVAL = 10.0
LOAD_CONFIG = PlannerConfig(
    planner="load",
    planner_interval_s=INTERVAL,
    planner_scale_out_cooldown_s=20.0,
    planner_scale_in_cooldown_s=60.0,
)


def pool(n: int, waiting_total: float = 0.0, kv_total: float = 0.0, **kw) -> list[EngineSample]:
    """``n`` ready engines sharing a total queue and KV demand evenly."""
    return [
        EngineSample(f"e-{i}", True, waiting=round(waiting_total / n), kv_usage=kv_total / n, **kw)
        for i in range(n)
    ]


def run_load(planner: LoadPlanner, demand, rounds: int, start: int) -> list[int]:
    """Closed loop: each round the pool's demand (queue, KV summed over
    engines) is spread over its current size; the decision is applied."""
    n, sizes = start, []
    for k in range(rounds):
        waiting, kv = demand(k)
        (d,) = planner.decide(Observation(k * INTERVAL, {"decode": pool(n, waiting, kv)}))
        assert d.current == n and (d.action == HOLD) == (d.target == n), d
        n = d.target
        sizes.append(n)
    return sizes


def test_load_ramp_scales_out_then_in_after_the_cooldown():
    planner = LoadPlanner(LOAD_CONFIG, {"decode": (1, 4)})
    # a recorded ramp: queue demand (total waiting) up for 10 rounds, then nothing
    ramp = [0, 4, 10, 20, 30, 30, 30, 30, 30, 30] + [0] * 30
    sizes = run_load(planner, lambda k: (ramp[k], min(0.3 * ramp[k] / 10, 3.5)), 40, 1)
    assert max(sizes) == 4 and sizes[-1] == 1, sizes
    ups = [k for k in range(1, 40) if sizes[k] > sizes[k - 1]]
    downs = [k for k in range(1, 40) if sizes[k] < sizes[k - 1]]
    assert ups and downs and max(ups) < min(downs), sizes  # out during the ramp, in after
    # out: no two additions closer than the scale-out cooldown (2 rounds)
    assert all(b - a >= 2 for a, b in zip(ups, ups[1:])), sizes
    # in: the first removal waits the scale-in cooldown (6 rounds) after the last change
    assert min(downs) - max(ups) >= 6, sizes
    assert all(b - a >= 6 for a, b in zip(downs, downs[1:])), sizes


def test_no_figures_at_all_scales_in_to_the_minimum():
    """Zero traffic, and engines that never reported (no stats): idle, not unknown."""
    planner = LoadPlanner(LOAD_CONFIG, {"prefill": (1, 4), "decode": (2, 4)})
    sizes = {"prefill": 4, "decode": 4}
    for k in range(40):
        pools = {
            r: [EngineSample(f"{r}-{i}", ready=False) for i in range(n)] for r, n in sizes.items()
        }
        for d in planner.decide(Observation(k * INTERVAL, pools)):
            sizes[d.pool] = d.target
            if d.action == SCALE_IN:
                assert d.reason == "no_traffic", d
    assert sizes == {"prefill": 1, "decode": 2}


@pytest.mark.parametrize("kv_demand", [0.3, 0.6, 0.75, 0.79, 0.85, 1.2, 1.7, 2.4, 3.3])
def test_steady_load_at_an_edge_never_oscillates(kv_demand):
    """Whatever the steady demand, the size moves one way and settles: removing
    an engine must leave the survivors (each N/(N-1) as loaded) under the
    high mark, else the planner would add it back and remove it again."""
    for start in (1, 2, 3, 4):
        planner = LoadPlanner(LOAD_CONFIG, {"decode": (1, 4)})
        sizes = run_load(planner, lambda k: (0, kv_demand), 60, start)
        changes = [b - a for a, b in zip([start, *sizes], sizes) if b != a]
        assert all(c > 0 for c in changes) or all(c < 0 for c in changes), (start, sizes)
        assert sizes[-10:] == [sizes[-1]] * 10, (start, sizes)


def sla_config(**kw) -> PlannerConfig:
    settings = dict(
        planner="sla",
        planner_profile="unused.json",
        ttft_slo_ms=300.0,
        itl_slo_ms=50.0,
        planner_interval_s=INTERVAL,
        planner_scale_out_cooldown_s=0.0,
        planner_scale_in_cooldown_s=60.0,
        planner_warmup_steps=32,
    )
    settings.update(kw)
    return PlannerConfig(**settings)


BOUNDS = {"prefill": (1, 16), "decode": (1, 16)}


def traffic(k: int, rate: float, prompt: int = 512, output: int = 100) -> dict:
    """Cumulative counters after ``k`` intervals at ``rate`` requests/s."""
    n = round(rate * INTERVAL * k)
    return dict(arrivals=n, prompt_tokens=n * prompt, finished=n, output_tokens=n * output)


def test_sla_counts_are_the_arithmetics_for_known_rates():
    for rate in (2.0, 20.0, 45.0):
        planner = SlaPlanner(sla_config(), BOUNDS, profile())
        sizes = {"prefill": 1, "decode": 1}
        for k in range(3):
            pools = {r: pool(n) for r, n in sizes.items()}
            for d in planner.decide(Observation(k * INTERVAL, pools, **traffic(k, rate))):
                sizes[d.pool] = d.target
        pre, dec = required(Load(rate, 512, 100), profile(), 300.0, 50.0, (1, 1), (16, 16))
        assert (sizes["prefill"], sizes["decode"]) == (pre.engines, dec.engines), rate
    assert (pre.engines, dec.engines) != (1, 1)  # the high rate needed more than one


def test_sla_zero_traffic_goes_to_the_minimum_and_a_wobble_at_the_edge_holds():
    planner = SlaPlanner(sla_config(), BOUNDS, profile())
    sizes = {"prefill": 6, "decode": 3}
    pools = {r: pool(n) for r, n in sizes.items()}
    first = planner.decide(Observation(0.0, pools))  # a baseline: no interval yet
    assert {(d.action, d.reason) for d in first} == {(HOLD, "baseline")}
    decisions = planner.decide(Observation(INTERVAL, pools))  # no traffic in it
    assert {(d.pool, d.action, d.reason, d.target) for d in decisions} == {
        ("prefill", SCALE_IN, "no_traffic", 1),
        ("decode", SCALE_IN, "no_traffic", 1),
    }
    # 20 req/s needs 6 prefill engines, 22 needs 7 (test_sla_planner.py's
    # arithmetic); a rate wobbling between 20 and 22 settles on 7 and stays:
    # no scale-in cooldown, so only the arithmetic's margin holds it
    planner = SlaPlanner(sla_config(planner_scale_in_cooldown_s=0.0), BOUNDS, profile())
    sizes = {"prefill": 6, "decode": 1}
    counts = {"arrivals": 0, "prompt_tokens": 0, "finished": 0, "output_tokens": 0}
    seen = []
    for k in range(30):
        pools = {r: pool(n) for r, n in sizes.items()}
        obs = Observation(k * INTERVAL, pools, **counts)
        for d in planner.decide(obs):
            sizes[d.pool] = d.target
        seen.append(sizes["prefill"])
        n = round((20.0 if k % 2 else 22.0) * INTERVAL)
        counts = {key: v + n * {"arrivals": 1, "prompt_tokens": 512, "finished": 1,
                                "output_tokens": 100}[key] for key, v in counts.items()}  # fmt: skip
    assert seen[0] == 6 and set(seen[2:]) == {7}, seen


def test_cold_start_steps_do_not_count_as_speed():
    speed = SpeedCorrection(profile(), warmup_steps=32)
    expected = profile().decode_s(4, 1000)

    def engine(steps: int, step_s: float, epoch: int = 1) -> EngineSample:
        return EngineSample("decode-1", True, epoch, running=4, num_steps=steps,
                            last_step_s=step_s, context_tokens=1000)  # fmt: skip

    # a new engine's first steps are 50x slow: nothing changes
    for steps in (0, 5, 12, 31):
        assert speed.observe([engine(steps, 50 * expected)]) == 1.0
    # warm, at the profile's speed: still 1
    for steps in (40, 60, 90):
        assert speed.observe([engine(steps, expected)]) == pytest.approx(1.0)
    # a restart (new epoch) is a cold start again
    assert speed.observe([engine(3, 50 * expected, epoch=2)]) == pytest.approx(1.0)
    assert speed.observe([engine(20, 50 * expected, epoch=2)]) == pytest.approx(1.0)
    # warm and truly twice as slow: the factor follows
    factor = 1.0
    for steps in range(40, 400, 20):
        factor = speed.observe([engine(steps, 2 * expected, epoch=2)])
    assert factor == pytest.approx(2.0, rel=0.01)
    # ... and the sla planner's decode count follows the factor, not a cold engine's steps
    for cold in (True, False):
        planner = SlaPlanner(sla_config(planner_scale_in_cooldown_s=0.0), BOUNDS, profile())
        sizes = {"prefill": 1, "decode": 1}
        for k in range(4):
            steps = 3 + k if cold else 40 + 20 * k
            pools = {"prefill": pool(sizes["prefill"]),
                     "decode": [engine(steps, 30 * expected)] * sizes["decode"]}  # fmt: skip
            for d in planner.decide(Observation(k * INTERVAL, pools, **traffic(k, 20.0))):
                sizes[d.pool] = d.target
        base = required(Load(20.0, 512, 100), profile(), 300.0, 50.0, (1, 1), (16, 16))[1]
        if cold:
            assert sizes["decode"] == base.engines
        else:
            assert sizes["decode"] > base.engines


def test_runner_records_every_decision_and_resizes_only_on_a_change():
    planner = LoadPlanner(LOAD_CONFIG, {"prefill": (1, 2), "decode": (1, 4)})
    pools = {"prefill": pool(1), "decode": pool(2, waiting_total=40)}
    calls, recorded = [], []

    async def scale(role: str, n: int) -> dict:
        calls.append((role, n))
        if role == "decode":
            raise ValueError("refused")  # logged, the round goes on
        return {}

    runner = PlannerRunner(planner, lambda: Observation(0.0, pools), scale, recorded.append, 1.0)
    decisions = asyncio.run(runner.step())
    assert [(d.pool, d.action, d.reason) for d in decisions] == [
        ("prefill", HOLD, "at_min"),
        ("decode", SCALE_OUT, "queue_high"),
    ]
    assert recorded == decisions and calls == [("decode", 3)]
    assert decisions[1].inputs["queue_per_engine"] == 20.0


def test_planner_config_names_the_field():
    with pytest.raises(ValueError, match="--planner"):
        PlannerConfig(planner="fast")
    with pytest.raises(ValueError, match="planner-profile"):
        PlannerConfig(planner="sla")
    with pytest.raises(ValueError, match="planner_queue_low"):
        PlannerConfig(planner_queue_low=5.0)
    with pytest.raises(ValueError, match="planner_kv_low"):
        dataclasses.replace(PlannerConfig(), planner_kv_high=1.5)
    with pytest.raises(ValueError, match="a colocated pool"):
        SlaPlanner(sla_config(), {"colocated": (1, 2)}, profile())


def test_predicted_output_follows_a_shift_to_shorter_answers_at_once():
    """The ended requests' mean lags by a whole answer; the arrivals' max_tokens caps it."""
    from tandem.cluster.planner.autoscale import Predictor

    pred = Predictor()
    pred.observe(Observation(0.0, {}))
    long = pred.observe(Observation(10.0, {}, 100, 51200, 100, 51200, 51200))
    assert long.output_tokens == 512
    # new arrivals ask for 32 tokens; the requests that ended were still long ones
    short = pred.observe(Observation(20.0, {}, 200, 460800, 150, 76800, 54400))
    assert short.output_tokens == 32 and short.prompt_tokens == 4096


def test_the_sla_planner_in_the_simulator_follows_a_shifting_mix():
    """cluster/planner/elastic.py: four slots, a decode-heavy phase then a
    prefill-heavy one; the planner moves engines from decode to prefill,
    never holds more than four, and the run is deterministic."""
    import random

    from tandem.cluster.planner.elastic import ElasticSimulator
    from tandem.cluster.planner.simulator import SimRequest

    rng = random.Random(0)
    requests, t = [], 0.0
    while t < 120.0:
        t += rng.expovariate(4.0 if t < 60 else 3.0)
        prompt, out = (64, 200) if t < 60 else (2000, 4)
        requests.append(SimRequest(t, [rng.randrange(3, 30000) for _ in range(prompt)], out))
    prof = dataclasses.replace(
        profile(),
        prefill_tokens=[1, 4096],  # about 0.1 ms a prompt token
        prefill_time_s=[0.005, 0.4],
        scheduler={"block_size": 16, "num_kv_blocks": 4096, "max_num_batched_tokens": 2048,
                   "max_num_seqs": 64, "max_model_len": 4096},
    )  # fmt: skip

    def run():
        bounds = {"prefill": (1, 3), "decode": (1, 3)}
        planner = SlaPlanner(sla_config(planner_scale_in_cooldown_s=10.0), bounds, prof)
        sim = ElasticSimulator(prof, 1, 3, planner, interval_s=5.0, cold_start_s=5.0, slots=4)
        records = sim.run(requests)  # check_integrity() on every engine inside
        return sim, [r.token_times for r in records]

    sim, times = run()
    assert all(p + d <= 4 for _, p, d in sim.sizes), sim.sizes
    phase_a = [(p, d) for t, p, d in sim.sizes if 20 < t <= 60]
    phase_b = [(p, d) for t, p, d in sim.sizes if 70 < t <= 120]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # decode engines went to prefill when the long prompts came
    assert mean([d for _, d in phase_a]) > mean([d for _, d in phase_b]), sim.sizes
    assert mean([p for p, _ in phase_b]) > mean([p for p, _ in phase_a]), sim.sizes
    assert any(d.action == SCALE_IN and d.pool == "decode" for d in sim.decisions)
    assert run()[1] == times  # the same workload gives the same result
