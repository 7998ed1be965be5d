"""Pool moves (cluster/planner/moves.py): the sla planner takes a growing
pool's engines from the other pool's surplus (the counts stay the model's),
the runner moves an engine where the backend can and resizes where it
cannot, and in the simulator (elastic.py, ``switch_s``) a moved decode
engine's streams migrate token for token while it serves prefill with no
cold start."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from tandem.cluster.planner.autoscale import (
    HOLD,
    MOVE_IN,
    MOVE_OUT,
    SCALE_IN,
    SCALE_OUT,
    Decision,
    Observation,
    SlaPlanner,
)
from tandem.cluster.planner.moves import pair, plan
from tandem.cluster.planner.runner import PlannerRunner
from tests.unit.test_planner_autoscale import BOUNDS, INTERVAL, sla_config
from tests.unit.test_planner_watch import counters, decode, prefill, profile


def test_a_growing_pool_takes_the_shrinking_pools_surplus_first():
    grow = Decision("prefill", SCALE_OUT, "ttft_breach", 1, 3)
    shrink = Decision("decode", SCALE_IN, "itl_slo_met_with_fewer", 3, 1)
    moved = pair([grow, shrink])
    assert [(d.pool, d.action, d.current, d.target, d.moved, d.source) for d in moved] == [
        ("prefill", MOVE_IN, 1, 3, 2, "decode"),
        ("decode", MOVE_OUT, 3, 1, 2, "decode"),
    ]
    assert moved[0].reason == "ttft_breach"  # the model's reason stays
    assert plan(moved) == [("move", "decode", "prefill")] * 2
    # without moves the same decisions are a stop and a start, the stop first
    assert plan(moved, can_move=False) == [("scale", "decode", 1), ("scale", "prefill", 3)]
    # a larger growth than the surplus: the rest is a new engine
    part = pair([Decision("prefill", SCALE_OUT, "ttft_slo", 1, 4), shrink])
    assert (part[0].action, part[0].moved, part[1].moved) == (MOVE_IN, 2, 2)
    assert plan(part) == [("move", "decode", "prefill")] * 2 + [("scale", "prefill", 4)]
    # both growing, or nothing shrinking: no move
    both = [grow, Decision("decode", SCALE_OUT, "itl_slo", 1, 2)]
    assert pair(both) == both
    held = [grow, Decision("decode", HOLD, "itl_slo_met", 3, 3)]
    assert pair(held) == held


def breach_rounds(planner: SlaPlanner) -> list[Decision]:
    """test_planner_watch's round (prefill 1 -> 2, decode 2 -> 1 by the model)."""
    planner.decide(Observation(0.0, {"prefill": prefill([0]), "decode": decode(2)}))  # baseline
    obs = Observation(INTERVAL, {"prefill": prefill([0]), "decode": decode(2)}, **counters(50))
    return planner.decide(obs)


def test_the_sla_planner_moves_only_where_the_deployment_can():
    plain = breach_rounds(SlaPlanner(sla_config(), BOUNDS, profile()))
    assert [(d.pool, d.action, d.target) for d in plain] == [
        ("prefill", SCALE_OUT, 2),
        ("decode", SCALE_IN, 1),
    ]
    moving = breach_rounds(SlaPlanner(sla_config(), BOUNDS, profile(), moves=True))
    # the same counts by the same model, as one move
    assert [(d.pool, d.action, d.target, d.moved) for d in moving] == [
        ("prefill", MOVE_IN, 2, 1),
        ("decode", MOVE_OUT, 1, 1),
    ]
    assert [d.reason for d in moving] == [d.reason for d in plain]
    assert moving[1].inputs == plain[1].inputs


def test_the_runner_moves_where_the_backend_can_and_resizes_where_it_cannot():
    decisions = [
        Decision("prefill", MOVE_IN, "ttft_breach", 1, 3, moved=1, source="decode"),
        Decision("decode", MOVE_OUT, "itl_slo_met_with_fewer", 2, 1, moved=1, source="decode"),
    ]

    class Planner:
        def decide(self, obs):
            return decisions

    calls: list[tuple] = []

    async def scale(role: str, n: int) -> dict:
        calls.append(("scale", role, n))
        return {}

    async def move(source: str, dest: str) -> dict:
        calls.append(("move", source, dest))
        return {}

    recorded: list[Decision] = []
    obs = lambda: Observation(0.0, {})  # noqa: E731
    runner = PlannerRunner(Planner(), obs, scale, recorded.append, INTERVAL, move=move)
    asyncio.run(runner.step())
    assert calls == [("move", "decode", "prefill"), ("scale", "prefill", 3)]
    assert recorded == decisions
    calls.clear()
    asyncio.run(PlannerRunner(Planner(), obs, scale, recorded.append, INTERVAL).step())
    assert calls == [("scale", "decode", 1), ("scale", "prefill", 3)]


def shifting_mix() -> list:
    """test_planner_watch's mix: decode-heavy, then at 60 s long prompts that
    overload one prefill engine (6 req/s of 0.2 s prompts)."""
    from tandem.cluster.planner.simulator import SimRequest

    rng = random.Random(0)
    requests, t = [], 0.0
    while t < 120.0:
        t += rng.expovariate(4.0 if t < 60 else 6.0)
        prompt, out = (64, 200) if t < 60 else (2000, 4)
        requests.append(SimRequest(t, [rng.randrange(3, 30000) for _ in range(prompt)], out))
    return requests


def test_in_the_simulator_a_moved_engine_serves_prefill_without_a_cold_start():
    from tandem.cluster.planner.elastic import ElasticSimulator

    requests = shifting_mix()
    prof = dataclasses.replace(
        profile(),
        scheduler={"block_size": 16, "num_kv_blocks": 4096, "max_num_batched_tokens": 2048,
                   "max_num_seqs": 64, "max_model_len": 4096},
    )  # fmt: skip

    def run(switch_s: float | None):
        bounds = {"prefill": (1, 3), "decode": (1, 3)}
        config = sla_config(planner_scale_in_cooldown_s=10.0, planner_watch_interval_s=1.0)
        planner = SlaPlanner(config, bounds, prof, moves=switch_s is not None)
        sim = ElasticSimulator(prof, 1, 3, planner, interval_s=5.0, cold_start_s=20.0, slots=4,
                               watch_interval_s=1.0, switch_s=switch_s)  # fmt: skip
        records = sim.run(requests)  # check_integrity() on every engine inside
        return sim, records

    def first_second_prefill(sim) -> float:
        """When a second prefill engine first took requests after the shift."""
        late = [
            sim.joins_at.get(e.index, 0.0)
            for e in sim.prefill
            if e.index not in sim.gone and 60.0 < sim.joins_at.get(e.index, 0.0) < 1e9
        ]
        return min(late)

    cold, _ = run(None)
    moved, records = run(0.5)
    assert moved.moves and all(src == "decode" for _, src, dst in moved.moves if dst == "prefill")
    assert all(p + d <= 4 for _, p, d in moved.sizes), moved.sizes
    assert any(d.action == MOVE_IN for d in moved.decisions)
    assert not any(d.action in (MOVE_IN, MOVE_OUT) for d in cold.decisions)
    # moved: serving 0.5 s after its streams left; a new engine: 20 s after it was asked for
    assert first_second_prefill(moved) < first_second_prefill(cold) - 10.0
    # every stream ran to its length, the migrated ones included, none failed
    assert not any(r.error for r in records)
    assert all(len(r.token_times) == r.output_len for r in records)
    assert all(r.token_times == sorted(r.token_times) for r in records)
    assert [r.token_times for r in run(0.5)[1]] == [r.token_times for r in records]


def test_in_the_simulator_a_moving_decode_engines_streams_migrate_token_for_token():
    """1P2D, eight long streams on the two decode engines; at the round at 2 s
    a planner moves one decode engine to prefill. Its streams continue on the
    other decode engine to their full length; it serves prefill ``switch_s``
    after they left and takes the prompts that arrive then."""
    from tandem.cluster.planner.elastic import ElasticSimulator
    from tandem.cluster.planner.simulator import SimRequest

    prof = dataclasses.replace(
        profile(),
        scheduler={"block_size": 16, "num_kv_blocks": 4096, "max_num_batched_tokens": 2048,
                   "max_num_seqs": 64, "max_model_len": 4096},
    )  # fmt: skip
    rng = random.Random(1)
    ids = lambda n: [rng.randrange(3, 30000) for _ in range(n)]  # noqa: E731
    requests = [SimRequest(0.01 * i, ids(300), 400) for i in range(8)]
    requests += [SimRequest(3.0 + 0.1 * i, ids(1500), 8) for i in range(10)]

    class MoveOnce:
        """At its first round with every stream running, decode -> prefill."""

        def __init__(self) -> None:
            self.done = False

        def decide(self, obs):
            dec = obs.pools["decode"]
            if self.done or sum(e.running for e in dec) < 8:
                return []
            self.done = True
            n_p, n_d = len(obs.pools["prefill"]), len(dec)
            return pair([Decision("prefill", SCALE_OUT, "test", n_p, n_p + 1),
                         Decision("decode", SCALE_IN, "test", n_d, n_d - 1)])  # fmt: skip

    def run(handoff_min_tokens: int = 256):
        sim = ElasticSimulator(prof, 1, 2, MoveOnce(), interval_s=2.0, cold_start_s=60.0,
                               slots=3, switch_s=0.25,
                               migration_handoff_min_tokens=handoff_min_tokens)  # fmt: skip
        return sim, sim.run(requests)  # check_integrity() on every engine inside

    # contexts of 300+ tokens: prefilled again by the prefill engine, then handed off
    sim, records = run()
    ((t_move, src, dst),) = sim.moves
    assert (src, dst) == ("decode", "prefill")
    assert sim.migrated >= 1 and sim.reprefilled == sim.migrated
    moved_to = sim.prefill[-1]
    assert t_move < sim.joins_at[moved_to.index] <= t_move + 1.0  # drained, then 0.25 s
    assert moved_to.num_steps > 0  # it computed the late prompts
    assert [len(r.token_times) for r in records] == [r.output_len for r in records]
    assert all(not r.error and r.token_times == sorted(r.token_times) for r in records)
    assert [r.token_times for r in run()[1]] == [r.token_times for r in records]
    # below the handoff threshold: the other decode engine recomputes them
    sim, records = run(handoff_min_tokens=10_000)
    assert sim.migrated >= 1 and sim.reprefilled == 0
    assert [len(r.token_times) for r in records] == [r.output_len for r in records]
    assert all(not r.error and r.token_times == sorted(r.token_times) for r in records)


def test_the_service_asks_for_moves_only_from_a_scaler_that_can_move():
    from tandem.cluster.cli.planning import pool_mover
    from tandem.cluster.disagg.scaling import PoolScaler
    from tandem.cluster.engines.placement import PoolsConfig

    def scaler(moves_off: str | None) -> PoolScaler:
        return PoolScaler(None, [], PoolsConfig(), output_addr="", namespace="",
                          gateway_session=0, moves_off=moves_off)  # fmt: skip

    # the service's scaler moves only where its pools are alike (cluster/engines/pool_moves.py)
    assert pool_mover(scaler("the pools' engines differ in max_num_seqs")) is None
    assert pool_mover(scaler(None)) is not None
    assert pool_mover(object()) is None
    calls = []

    class Mover:
        async def move_engine(self, pool: str, dest: str, source: str = "admin") -> dict:
            calls.append((pool, dest, source))
            return {}

    move = pool_mover(Mover())
    asyncio.run(move("decode", "prefill"))
    assert calls == [("decode", "prefill", "planner")]


def test_a_move_between_unlike_pools_is_refused_naming_why():
    """The check before any engine is touched (cluster/disagg/pool_move.py): pools whose
    engines differ, a pool's last engine, a full destination, an unknown engine."""
    from types import SimpleNamespace

    from tandem.cluster.disagg.pool_move import check_move
    from tandem.cluster.disagg.scaling import PoolScaler
    from tandem.cluster.engines.placement import PoolConfig, PoolsConfig

    def engine(eid: str, role: str) -> SimpleNamespace:
        return SimpleNamespace(state=SimpleNamespace(engine_id=eid, role=role, ready=True))

    engines = {e.state.engine_id: e for e in (engine("prefill-0", "prefill"),
               engine("decode-0", "decode"), engine("decode-1", "decode"))}  # fmt: skip
    pools = PoolsConfig(
        prefill=PoolConfig("prefill", 1, max_engines=2), decode=PoolConfig("decode", 2)
    )

    def refusal(moves_off, source_pool, dest_pool, engine_id=None, cfg=pools) -> str:
        s = PoolScaler(SimpleNamespace(engines=engines), [], cfg, output_addr="",
                       namespace="", gateway_session=0, moves_off=moves_off)  # fmt: skip
        with pytest.raises(ValueError) as info:
            check_move(s, source_pool, dest_pool, engine_id)
        if not str(info.value).startswith(("source_pool", "dest_pool")) or s.log.events:
            assert s.log.events[-1].outcome == "refused"  # counted once the pools are known
        return str(info.value)

    why = "the pools' engines differ in max_num_seqs (prefill 128, decode 8: ...)"
    text = refusal(why, "decode", "prefill")
    assert text.startswith("pool_moves: ") and why in text
    assert "--prefill-min-engines" in refusal(None, "prefill", "decode")
    full = PoolsConfig(
        prefill=PoolConfig("prefill", 1, max_engines=1), decode=PoolConfig("decode", 2)
    )
    assert refusal(None, "decode", "prefill", cfg=full).startswith("dest_pool: ")
    assert "--prefill-max-engines" in refusal(None, "decode", "prefill", cfg=full)
    assert refusal(None, "decode", "prefill", "decode-7").startswith("engine_id: ")
    assert refusal(None, "decode", "colocated").startswith("dest_pool: ")
