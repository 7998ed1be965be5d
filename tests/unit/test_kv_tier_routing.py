"""KV events that name the medium (scheduler/kv_events.py) and the router's use of
them (cluster/routing/index.py, policy.py): a prefix in an engine's host tier scores
below a device hit of the same engine and above nothing, for its holder and (less)
for the other engines, which can READ it over NIXL."""

import msgspec

from tandem.cluster.routing.index import PrefixIndex
from tandem.cluster.routing.policy import Choice
from tandem.scheduler.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
    KVSnapshot,
)
from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tests.unit.test_kv_routing import BLOCK, SimCluster


class _Tiers:  # what the recorder asks of kvtransfer/tiers' TierStore
    def __init__(self) -> None:
        self.events: list = []
        self.index = {"host": [b"h1"]}

    def take_events(self):
        events, self.events = self.events, []
        return events

    def tier_hashes(self):
        return self.index


def test_medium_is_appended_with_device_as_default_on_the_wire():
    new = msgspec.msgpack.encode(BlockStored([b"a"], None, 4, "host"))
    # a batch from before the field: the last element missing decodes as device
    old = msgspec.msgpack.encode(["BlockStored", [b"a"], None, 4])
    assert msgspec.msgpack.decode(old, type=BlockStored).medium == "device"
    assert msgspec.msgpack.decode(new, type=BlockStored).medium == "host"
    assert msgspec.msgpack.decode(
        msgspec.msgpack.encode(["BlockRemoved", [b"a"]]), type=BlockRemoved
    ) == BlockRemoved([b"a"], "device")
    snap = msgspec.msgpack.encode(["d0", 1, 2, [b"x"]])
    assert msgspec.msgpack.decode(snap, type=KVSnapshot).tier_block_hashes == {}


def test_recorder_takes_tier_changes_per_drain_and_in_snapshots():
    rec = KVEventRecorder("e", 1, BLOCK)
    rec.tiers = _Tiers()
    rec.stored([b"d1"], None)
    rec.tiers.events = [
        ("host", b"h1", True),
        ("host", b"h2", True),
        ("disk", b"k1", True),
        ("host", b"h0", False),
    ]
    rec.removed(b"d0")
    batch = rec.drain(0.0)
    kinds = [(type(ev).__name__, ev.medium, ev.block_hashes) for ev in batch.events]
    assert kinds == [  # the step's device events, then the tiers' (taken at the drain)
        ("BlockStored", "device", [b"d1"]),
        ("BlockRemoved", "device", [b"d0"]),  # removals merged, flushed before a store
        ("BlockStored", "host", [b"h1", b"h2"]),  # a run of one medium: one event
        ("BlockStored", "disk", [b"k1"]),
        ("BlockRemoved", "host", [b"h0"]),
    ]
    assert rec.drain(0.0) is None
    assert rec.snapshot([b"d1"]).tier_block_hashes == {"host": [b"h1"]}


def _batch(eid, seq, *events):
    return KVEventBatch(eid, 1, seq, 0.0, list(events))


def test_index_keeps_the_medium_per_engine_and_block():
    idx = PrefixIndex()
    for eid in ("a", "b"):
        idx.add_engine(eid, "decode", 8)
    h = [bytes([i]) * 32 for i in range(4)]
    assert idx.apply(
        _batch("a", 1, BlockStored(h[:1], None, 4), BlockStored(h[1:3], None, 8, "host"))
    )
    assert idx.apply(_batch("b", 1, BlockStored(h[3:], None, 4, "disk")))
    assert idx.hashes_of("a") == {h[0]} and idx.hashes_of("a", "host") == set(h[1:3])
    assert idx.match(h, ["a", "b"]) == {"a": 1, "b": 0}
    # a: device h0 + own host h1 h2; b: a's host is a READ away, but not a's device h0
    assert idx.match_below(h, ["a", "b"]) == {"a": 3, "b": 0}
    assert idx.match_below(h[1:], ["a", "b"]) == {"a": 2, "b": 3}  # b's own disk h3
    assert idx.match_below(h[1:], ["a", "b"], peers=False) == {"a": 2, "b": 0}
    idx.check_integrity()
    assert idx.apply(_batch("a", 2, BlockRemoved([h[2]], "host"), BlockRemoved([h[0]])))
    assert idx.match_below(h[1:], ["a", "b"]) == {"a": 1, "b": 1}
    snap = KVSnapshot("a", 1, 5, [h[0]], {"host": [h[3]]})
    idx.load_snapshot(snap)
    assert idx.hashes_of("a", "host") == {h[3]} and idx.hashes_of("a") == {h[0]}
    idx.drop_engine_state("a", 2)  # restarted: its tiers' entries go too
    assert not idx.hashes_of("a", "host")
    idx.check_integrity()


def test_host_tier_holder_scores_below_a_device_hit_and_above_nothing():
    c = SimCluster({"d0": "decode", "d1": "decode", "d2": "decode"}, load_weight=0.0)
    tokens = list(range(100, 133))  # 8 full blocks + 1 token
    hashes = c.hashes(tokens).of("decode")
    # d1's host tier holds the whole prefix, its device nothing
    assert c.index.apply(_batch("d1", 1, BlockStored(hashes[:8], None, 32, "host")))
    for eid in ("d0", "d2"):
        assert c.index.apply(_batch(eid, 1, BlockStored([b"?" * 32], None, 4)))  # in sync
    choice = c.route("decode", tokens)
    assert choice.engine.engine_id == "d1" and choice.reason == "tier_hit"
    assert choice.predicted_hit_tokens == 0  # a device hit is what the engine reports cached
    # d0 and d2 can READ it from d1's host tier: they score above a prefix held nowhere
    cost = _costs(c, tokens)
    assert cost["d1"] < cost["d0"] == cost["d2"] < 1.0
    # a device hit of the same length beats the tier
    assert c.index.apply(_batch("d2", 2, BlockStored(hashes[:8], None, 32)))
    choice = c.route("decode", tokens)
    assert choice.engine.engine_id == "d2" and choice.reason == "prefix_hit"
    c.index.check_integrity()


def test_an_engine_that_stored_nothing_yet_reads_a_peers_host_tier():
    idx = PrefixIndex()
    for eid in ("a", "fresh"):
        idx.add_engine(eid, "colocated", 8)
    h = [bytes([i]) * 32 for i in range(3)]
    assert idx.apply(_batch("a", 1, BlockStored(h[:2], None, 8, "host")))
    assert idx.engines["fresh"].needs_resync  # no event from it yet: nothing of its own known
    assert idx.match_below(h, ["a", "fresh"]) == {"a": 2, "fresh": 2}
    assert idx.match_below(h, ["a", "fresh"], peers=False) == {"a": 2, "fresh": 0}
    assert idx.host_run("a", h) == 2 and idx.host_run("a", h[1:]) == 1
    assert idx.host_run("fresh", h) == 0 and idx.host_run("unknown", h) == 0


def test_tier_lender_is_the_longest_host_run_beyond_the_readers_own():
    from tandem.cluster.disagg.tier_lending import LENDER_ROLES
    from tandem.cluster.routing.cluster_routing import ClusterRouting
    from tandem.cluster.routing.policy import RoutingConfig
    from tandem.cluster.routing.router import Router

    assert LENDER_ROLES == {
        "prefill": ("prefill", "decode"),  # P borrows before it prefills
        "decode": ("prefill", "decode"),  # D computing the prompt, from P or another D
        "colocated": ("colocated",),
    }
    router = Router()
    routing = ClusterRouting(RoutingConfig("kv-aware"), router, {"colocated": 3})
    info = {"block_size": BLOCK, "prefix_caching_hash_algo": "sha256", "num_kv_blocks": 64}
    for eid in ("c0", "c1", "c2"):
        router.add(eid, "colocated")
        routing.on_connected(eid, "colocated", dict(info, epoch=1))
    tokens = list(range(100, 133))  # 8 full blocks + 1 token
    ph = routing.hashes(EngineRequest("r", tokens, SamplingParams(max_tokens=2)))
    hashes = ph.of("colocated")
    assert len(hashes) == 8
    idx = routing.index
    assert idx.apply(_batch("c1", 1, BlockStored(hashes, None, 32, "host")))
    assert idx.apply(_batch("c2", 1, BlockStored(hashes[:3], None, 12, "host")))
    assert idx.apply(_batch("c0", 1, BlockStored(hashes[:2], None, 8)))
    reader = _Reader("c0")
    found = routing.tier_lender(ph, "colocated", ("colocated",), reader, ["c1", "c2"])
    assert found == ("c1", hashes[:8])  # every full block: the last token is past them
    # the reader's own tiers hold as long a run: nothing to lend
    assert idx.apply(_batch("c0", 2, BlockStored(hashes[2:], None, 24, "disk")))
    assert routing.tier_lender(ph, "colocated", ("colocated",), reader, ["c1", "c2"]) is None
    routing.count("tier_lend", "lent")
    assert routing.decisions() == {"tier_lend/lent": 1}


def test_disaggregated_plan_counts_the_tokens_tiers_hold():
    c = SimCluster({"p0": "prefill", "d0": "decode", "d1": "decode"}, disagg_min_tokens=24)
    tokens = list(range(100, 133))  # 8 full blocks + 1 token
    hashes = c.hashes(tokens).of("decode")
    for eid in ("d0", "d1", "p0"):
        assert c.index.apply(_batch(eid, 1, BlockStored([b"?" * 32], None, 4)))  # in sync
    plan = c.policy.plan_disaggregated(len(tokens), hashes, BLOCK, True)
    assert plan.remote_prefill and plan.reason == "remote_prefill"  # held nowhere
    # d1's host tier holds every full block: D borrows (or loads) it, no prefill engine
    assert c.index.apply(_batch("d1", 2, BlockStored(hashes, None, 32, "host")))
    plan = c.policy.plan_disaggregated(len(tokens), hashes, BLOCK, True)
    assert not plan.remote_prefill and plan.reason == "tiers_hold_prompt"
    assert plan.decode.predicted_hit_tokens == 0 and plan.decode.below_tokens == 32
    # a longer prompt: the tiers hold 32 of 41 tokens, 9 to compute < 24: on D
    longer = tokens + list(range(8))
    plan = c.policy.plan_disaggregated(len(longer), c.hashes(longer).of("decode"), BLOCK, True)
    assert not plan.remote_prefill and plan.reason == "small_miss"
    # 32 tokens past the tier's prefix: worth a prefill engine (which may borrow it)
    longest = tokens + list(range(32))
    plan = c.policy.plan_disaggregated(len(longest), c.hashes(longest).of("decode"), BLOCK, True)
    assert plan.remote_prefill and plan.reason == "remote_prefill"
    assert c.policy.decisions[("route", "tiers_hold_prompt")] == 1
    c.index.check_integrity()


class _Actor:
    """A lender's ``kv_tier_export`` as the gateway awaits it (a Ray method's shape)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.asked: list = []
        self.kv_tier_export = self

    def remote(self, run):
        self.asked.append(run)

        async def reply():
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

        return reply()


def test_a_prefill_engine_borrows_and_keeps_its_handoff_flag():
    import asyncio
    from types import SimpleNamespace

    from tandem.cluster.disagg.tier_lending import TierLending
    from tandem.cluster.routing.cluster_routing import ClusterRouting
    from tandem.cluster.routing.policy import RoutingConfig
    from tandem.cluster.routing.router import Router
    from tandem.kvtransfer.handoff import prefill_request

    router = Router()
    routing = ClusterRouting(RoutingConfig("kv-aware"), router, {"prefill": 1, "decode": 2})
    info = {"block_size": BLOCK, "prefix_caching_hash_algo": "sha256", "num_kv_blocks": 64}
    engines = {}
    for eid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        st = router.add(eid, role)
        st.epoch = 3
        routing.on_connected(eid, role, dict(info, epoch=1))  # the index's (events') epoch
        engines[eid] = SimpleNamespace(
            state=st, answered=True, pushed_endpoints=None, handle=SimpleNamespace()
        )
    endpoints = [[eid, 3, "h", 1] for eid in ("d1", "p0")]  # d0 has no host tier
    for e in engines.values():
        e.pushed_endpoints = (3, endpoints)
    tokens = list(range(100, 133))
    request = EngineRequest("r", tokens, SamplingParams(max_tokens=4))
    ph = routing.hashes(request)
    hashes = ph.of("prefill")
    assert routing.index.apply(_batch("d1", 1, BlockStored(hashes[:5], None, 20, "host")))
    assert routing.index.apply(_batch("p0", 1, BlockStored(hashes[:2], None, 8)))
    lent = {"do_remote_prefill": True, "remote_medium": "host", "num_tokens": 5 * BLOCK}
    actor = _Actor(lent)
    engines["d1"].handle.actor = actor
    lending = TierLending(engines, routing)
    choice = Choice(router.engines["p0"], "prefix_hit", 2 * BLOCK)

    out = asyncio.run(lending.lend(choice, prefill_request(request), ph))
    assert actor.asked == [hashes[:5]]  # d1's run, longer than p0's device hit
    assert out.kv_transfer_params == {**lent, "do_remote_decode": True}
    assert choice.predicted_hit_tokens == 5 * BLOCK
    assert routing.log_fields("r") == {  # the request's finished line names the lender
        "router": "kv-aware",
        "tier_lender": "d1",
        "tier_lent_tokens": 5 * BLOCK,
    }
    # the reader does not know d1 at its epoch: nothing asked
    engines["p0"].pushed_endpoints = (3, [["p0", 3, "h", 1]])
    assert asyncio.run(lending.lend(choice, prefill_request(request), ph)).kv_transfer_params == {
        "do_remote_decode": True
    }
    engines["p0"].pushed_endpoints = (3, endpoints)
    # a decode engine computing the prompt borrows from the other decode engine
    d_choice = Choice(router.engines["d0"], "load", 0)
    assert asyncio.run(lending.lend(d_choice, request, ph)).kv_transfer_params == lent
    # an error or nothing to lend: the request goes plain
    actor.answer = TimeoutError("late")
    assert asyncio.run(lending.lend(d_choice, request, ph)) is request
    actor.answer = None
    assert asyncio.run(lending.lend(d_choice, request, ph)) is request
    assert routing.decisions() == {
        "tier_lend/failed": 1,
        "tier_lend/lent": 2,
        "tier_lend/none": 1,
    }


class _Reader:
    def __init__(self, engine_id: str) -> None:
        self.state = type("S", (), {"engine_id": engine_id})()


def _costs(c: SimCluster, tokens) -> dict[str, float]:
    """The policy's miss term per engine (its ``held`` tokens), via choose's pieces."""
    from tandem.cluster.routing.policy import PEER_TIER_HIT_WEIGHT, TIER_HIT_WEIGHT

    h = c.hashes(tokens).of("decode")
    cands = [c.router.engines[e] for e in ("d0", "d1", "d2")]
    hit = c.policy._hits(cands, h, len(tokens), BLOCK)
    own = c.policy._hits(cands, h, len(tokens), BLOCK, below="own")
    below = c.policy._hits(cands, h, len(tokens), BLOCK, below="peers")
    n = len(tokens)
    return {
        e: (n - hit[e] - TIER_HIT_WEIGHT * (own[e] - hit[e])
            - PEER_TIER_HIT_WEIGHT * (below[e] - own[e])) / n
        for e in hit
    }  # fmt: skip


def test_only_an_engine_that_reads_over_nixl_counts_a_peers_host_tier():
    """A prefill engine serving only (kv role "prefill") cannot be lent a peer's tier:
    the plan scores it on its own prefix; one that reads ("both": a tier of its own,
    or ``kv_borrows_tiers``) counts the peer's tier and is chosen for it."""
    from tandem.cluster.routing.policy import reads_peers

    c = SimCluster({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    tokens = list(range(100, 133))  # 8 full blocks + 1 token
    hashes = c.hashes(tokens).of("prefill")
    assert c.index.apply(_batch("d0", 1, BlockStored(hashes, None, 32, "host")))
    for eid in ("p0", "p1"):
        assert c.index.apply(_batch(eid, 1, BlockStored([b"?" * 32], None, 4)))  # in sync
    c.router.engines["p0"].info = {"kv_role": "prefill"}
    c.router.engines["p1"].info = {"kv_role": "both"}
    assert [reads_peers(c.router.engines[e]) for e in ("p0", "p1", "d0")] == [False, True, True]
    choice = c.route("prefill", tokens)
    assert choice.engine.engine_id == "p1" and choice.reason == "tier_hit"
    assert choice.below_tokens == 32
    # with no reader among them, nothing below counts: the plain cost picks
    c.router.engines["p1"].info = {"kv_role": "prefill"}
    choice = c.route("prefill", tokens)
    assert choice.reason == "load" and choice.below_tokens == 0
    # an engine without the connector (a colocated one with no peers) reads nothing
    assert not reads_peers(type(choice.engine)("c0", "colocated", info={"kv_role": None}))
