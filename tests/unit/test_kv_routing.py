"""Router policies (cluster/routing/policy.py) over simulated engines:
real schedulers, real KV events, the real index and hash function."""

import random

import pytest

from tandem.cluster.routing.cluster_routing import PromptHashes
from tandem.cluster.routing.index import PrefixIndex
from tandem.cluster.routing.policy import RoutingConfig, RoutingPolicy
from tandem.cluster.routing.router import Router
from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tests.unit.kv_sim import SimEngine

BLOCK = 4


class SimCluster:
    """Engines + router state + index, routed one request at a time."""

    def __init__(self, roles: dict[str, str], policy: str = "kv-aware", **weights) -> None:
        self.router = Router(disagg_min_tokens=weights.pop("disagg_min_tokens", 0))
        self.index = PrefixIndex()
        self.engines = {}
        for eid, role in roles.items():
            st = self.router.add(eid, role)
            st.ready, st.max_num_seqs = True, 4
            self.engines[eid] = SimEngine(eid, num_blocks=128, block_size=BLOCK)
            self.index.add_engine(eid, role, 128)
        self.policy = RoutingPolicy(
            RoutingConfig(policy, **weights), self.router, self.index, policy
        )
        self.hashing = {role: (BLOCK, "sha256") for role in set(roles.values())}

    def hashes(self, tokens, salt=None) -> PromptHashes:
        req = EngineRequest("x", tokens, SamplingParams(max_tokens=2), cache_salt=salt)
        return PromptHashes(req, self.hashing)

    def route(self, role, tokens, salt=None):
        h = self.hashes(tokens, salt)
        return self.policy.choose(role, len(tokens), h.of(role), block_size=BLOCK)

    def run(self, eid, rid, tokens, salt=None):
        eng = self.engines[eid]
        eng.add(rid, tokens, salt=salt)
        eng.run_until_idle()
        for b in eng.take_batches():
            assert self.index.apply(b)
        return eng.first_outputs[rid].num_cached_tokens


def _prefixes(rng, num, length):
    return [[rng.randrange(1000) for _ in range(length)] for _ in range(num)]


def test_same_prefix_lands_on_its_holder():
    rng = random.Random(0)
    c = SimCluster({"d0": "decode", "d1": "decode"})
    prefixes = _prefixes(rng, 4, 32)
    home: dict[int, str] = {}
    for i in range(40):
        p = rng.randrange(4)
        tokens = prefixes[p] + [rng.randrange(1000) for _ in range(6)]
        choice = c.route("decode", tokens)
        if p in home:
            assert choice.engine.engine_id == home[p], f"prefix {p} moved"
            assert choice.reason == "prefix_hit"
        home.setdefault(p, choice.engine.engine_id)
        c.run(choice.engine.engine_id, f"r{i}", tokens)
    assert len(set(home.values())) == 2, "four prefixes all on one engine"
    for eid, eng in c.engines.items():
        assert c.index.hashes_of(eid) == eng.cached()
        eng.sched.check_integrity()


def test_overloaded_holder_loses_the_prefix():
    rng = random.Random(1)
    c = SimCluster({"d0": "decode", "d1": "decode"})
    tokens = _prefixes(rng, 1, 32)[0]
    holder = c.route("decode", tokens).engine.engine_id
    c.run(holder, "r0", tokens)
    assert c.route("decode", tokens).engine.engine_id == holder
    st = c.router.engines[holder]
    st.num_running, st.kv_cache_usage = 2 * st.max_num_seqs, 0.95  # overloaded
    other = c.route("decode", tokens)
    assert other.engine.engine_id != holder and other.reason == "load"


def _dispatch_shared_prefix(c: SimCluster, num: int) -> list[str]:
    """``num`` requests sharing one prefix, each counted in flight on its
    engine (none finishes); the first is run so its engine caches the prefix."""
    rng = random.Random(11)
    prefix = _prefixes(rng, 1, 32)[0]
    picks = []
    for i in range(num):
        tokens = prefix + [rng.randrange(1000) for _ in range(6)]
        eid = c.route("colocated", tokens).engine.engine_id
        if i == 0:
            c.run(eid, "r0", tokens)
        c.router.engines[eid].num_inflight += 1
        picks.append(eid)
    return picks


def test_busy_holder_yields_to_an_idle_engine():
    """max_num_seqs 4: a holder with 3 requests in flight has load 0.75. The
    cost alone keeps it (0.75 + a small miss beats an idle engine's whole
    miss, 1.0) until it is fuller by a whole engine's worth; past the busy
    threshold (0.5) it yields while the other engine idles."""
    c = SimCluster({"c0": "colocated", "c1": "colocated"})
    picks = _dispatch_shared_prefix(c, 6)
    holder = picks[0]
    other = "c1" if holder == "c0" else "c0"
    # loads before each pick: 0, 0.25, 0.5 (<= 0.5: affinity), then 0.75 (busy)
    assert picks[:4] == [holder, holder, holder, other], picks
    assert picks.count(other) >= 2  # it caches the prefix too: both take turns
    # with the threshold off (a load no engine reaches) the other engine idles
    # until the holder's running share is full (load 1.0 + its miss > 1.0)
    c = SimCluster({"c0": "colocated", "c1": "colocated"}, busy_threshold=100.0)
    picks = _dispatch_shared_prefix(c, 6)
    assert picks[:5] == [holder] * 4 + [other], picks  # the same prompts: the same holder


def test_every_engine_busy_the_cost_decides():
    c = SimCluster({"c0": "colocated", "c1": "colocated"})
    tokens = _prefixes(random.Random(12), 1, 32)[0]
    c.run("c1", "r0", tokens)
    for st in c.router.engines.values():
        st.num_running = 3  # load 0.75 each: both busy
    choice = c.route("colocated", tokens)
    assert (choice.engine.engine_id, choice.reason) == ("c1", "prefix_hit")


def test_predicted_hit_equals_reported_hit_without_eviction():
    rng = random.Random(2)
    c = SimCluster({"d0": "decode", "d1": "decode", "d2": "decode"})
    prefixes = _prefixes(rng, 5, 24)
    num_hits = 0
    for i in range(40):
        tokens = rng.choice(prefixes)[: rng.randrange(5, 25)] + [
            rng.randrange(1000)
        ] * rng.randrange(0, 9)
        salt = rng.choice([None, "tenant"])
        choice = c.route("decode", tokens, salt)
        reported = c.run(choice.engine.engine_id, f"r{i}", tokens, salt)
        assert choice.predicted_hit_tokens == reported, (i, choice, reported)
        num_hits += reported > 0
    assert num_hits > 10


def test_salt_separates_tenants():
    rng = random.Random(3)
    c = SimCluster({"d0": "decode", "d1": "decode"})
    tokens = _prefixes(rng, 1, 20)[0]
    eid = c.route("decode", tokens, "a").engine.engine_id
    c.run(eid, "r0", tokens, "a")
    assert c.route("decode", tokens, "a").predicted_hit_tokens == 16
    assert c.route("decode", tokens, "b").predicted_hit_tokens == 0


def test_decode_holding_whole_prompt_skips_prefill():
    rng = random.Random(4)
    c = SimCluster({"p0": "prefill", "d0": "decode", "d1": "decode"})
    tokens = _prefixes(rng, 1, 30)[0]
    c.run("d1", "r0", tokens)  # d1 holds the prompt (as after a previous turn)
    h = c.hashes(tokens)
    plan = c.policy.plan_disaggregated(len(tokens), h.of("decode"), BLOCK, True)
    assert plan.decode.engine.engine_id == "d1"
    assert not plan.remote_prefill and plan.reason == "decode_holds_prompt"
    assert plan.decode.predicted_hit_tokens == 28  # all but the block of the last token
    longer = tokens + [rng.randrange(1000) for _ in range(40)]
    plan = c.policy.plan_disaggregated(len(longer), c.hashes(longer).of("decode"), BLOCK, True)
    assert plan.remote_prefill and plan.reason == "remote_prefill"
    assert c.router.num_decisions == {"remote": 1, "local": 1}
    assert c.policy.decisions[("route", "decode_holds_prompt")] == 1


def test_small_miss_on_decode_prefills_locally():
    rng = random.Random(5)
    c = SimCluster({"p0": "prefill", "d0": "decode"}, disagg_min_tokens=16)
    tokens = _prefixes(rng, 1, 40)[0]
    c.run("d0", "r0", tokens)
    longer = tokens + [rng.randrange(1000) for _ in range(10)]  # 12 uncached on d0
    plan = c.policy.plan_disaggregated(len(longer), c.hashes(longer).of("decode"), BLOCK, True)
    assert not plan.remote_prefill and plan.reason == "small_miss"
    cold = _prefixes(rng, 1, 40)[0]
    plan = c.policy.plan_disaggregated(len(cold), c.hashes(cold).of("decode"), BLOCK, True)
    assert plan.remote_prefill


def test_prefill_cost_trades_uncached_tokens_against_queue():
    rng = random.Random(6)
    c = SimCluster({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    tokens = _prefixes(rng, 1, 64)[0]
    c.run("p1", "r0", tokens)
    assert c.route("prefill", tokens).engine.engine_id == "p1"
    c.router.engines["p1"].queued_prefill_tokens = 61  # 60 cached tokens < 61 queued
    assert c.route("prefill", tokens).engine.engine_id == "p0"


def test_decode_holder_with_a_prefill_backlog_gives_way():
    rng = random.Random(7)
    c = SimCluster({"d0": "decode", "d1": "decode"})
    tokens = _prefixes(rng, 1, 64)[0]
    c.run("d1", "r0", tokens)
    # d1 would save 60 tokens of this prompt: a smaller backlog keeps it there
    c.router.engines["d1"].queued_prefill_tokens = 58
    assert c.route("decode", tokens).engine.engine_id == "d1"
    c.router.engines["d1"].queued_prefill_tokens = 62
    assert c.route("decode", tokens).engine.engine_id == "d0"


def test_round_robin_and_least_load():
    c = SimCluster({"d0": "decode", "d1": "decode"}, policy="round-robin")
    picks = [c.route("decode", [1, 2, 3, 4, 5]).engine.engine_id for _ in range(4)]
    assert picks == ["d0", "d1", "d0", "d1"]
    c = SimCluster({"d0": "decode", "d1": "decode"}, policy="least-load")
    c.router.engines["d0"].num_running = 3
    assert c.route("decode", [1, 2, 3]).engine.engine_id == "d1"
    assert c.policy.index is None


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="router must be one of"):
        RoutingConfig("fastest")
    with pytest.raises(ValueError, match="router_load_weight"):
        RoutingConfig(load_weight=-1)
    with pytest.raises(ValueError, match="router_busy_threshold"):
        RoutingConfig(busy_threshold=-0.1)
    assert RoutingConfig().resolve({"decode": 2}) == "kv-aware"
    assert RoutingConfig().resolve({"prefill": 1, "decode": 1}) == "least-load"
    assert RoutingConfig("round-robin").resolve({"decode": 4}) == "round-robin"


def test_serve_flags_turn_events_on_only_for_kv_aware(tmp_path):
    from tandem.cluster.cli.main import build_parser
    from tandem.cluster.cli.settings import pool_specs, resolve_config

    def specs(argv):
        args = build_parser().parse_args(["serve", *argv])
        return {s.role: s.config for s in pool_specs(resolve_config(args))}

    assert not any(c.kv_transfer.kv_events for c in specs([]).values())  # 1P + 1D: least-load
    assert all(c.kv_transfer.kv_events for c in specs(["--decode", "2"]).values())  # auto: kv-aware
    assert all(c.kv_transfer.kv_events for c in specs(["--router", "kv-aware"]).values())
    assert not any(
        c.kv_transfer.kv_events
        for c in specs(["--colocated", "4", "--router", "round-robin"]).values()
    )
    args = build_parser().parse_args(["serve", "--router-load-weight", "0.5"])
    assert resolve_config(args).routing.load_weight == 0.5
    args = build_parser().parse_args(["serve", "--router-busy-threshold", "0.8"])
    assert resolve_config(args).routing.busy_threshold == 0.8
    bad = tmp_path / "bad.yaml"
    bad.write_text("router: fastest\n")
    with pytest.raises(ValueError, match="router must be one of"):
        resolve_config(build_parser().parse_args(["serve", "--config", str(bad)]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--router", "fastest"])
