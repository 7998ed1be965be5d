"""In-flight counts shared between gateways (``cluster/routing/peer_load.py``):
real ``PeerLoadChannel``s over one directory, each with its own router, as
the gateways of ``--api-server-count`` run them; clocks injected."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from tandem.cluster.routing.cluster_routing import ClusterRouting
from tandem.cluster.routing.index import PrefixIndex
from tandem.cluster.routing.peer_load import (
    EXPIRE_AFTER_S,
    HEARTBEAT_S,
    LoadRecord,
    PeerLoad,
    PeerLoadChannel,
    decode_record,
    encode_record,
    own_counts,
)
from tandem.cluster.routing.policy import RoutingConfig, RoutingPolicy
from tandem.cluster.routing.router import Router, load
from tandem.scheduler.block_hash import hash_request_blocks
from tandem.scheduler.kv_events import BlockStored, KVEventBatch

ENGINES = ("colocated-0", "colocated-1")


class Clock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def make_router() -> Router:
    router = Router()
    for eid in ENGINES:
        st = router.add(eid, "colocated")
        st.ready, st.max_num_seqs = True, 8
    return router


def gateway(tmp_path, index: int, clock: Clock) -> PeerLoadChannel:
    return PeerLoadChannel(str(tmp_path), index, make_router(), clock=clock)


def peer_counts(ch: PeerLoadChannel) -> dict[str, tuple[int, int]]:
    return {
        eid: (st.peer_inflight, st.peer_queued_prefill_tokens)
        for eid, st in ch.router.engines.items()
    }


def test_each_gateway_scores_with_the_others_counts_added(tmp_path):
    clock = Clock()
    a, b, c = (gateway(tmp_path, i, clock) for i in range(3))
    a0 = a.router.engines["colocated-0"]
    a0.num_inflight, a0.queued_prefill_tokens = 6, 1500
    c.router.engines["colocated-0"].num_inflight = 1
    c.router.engines["colocated-1"].num_inflight = 2
    # without the others' counts, b sees two idle engines and picks the first by id
    assert b.router.pick_generator("colocated").engine_id == "colocated-0"
    for ch in (a, b, c):
        ch.tick()
    b.tick()  # b read a and c before they wrote: read again
    assert peer_counts(b) == {"colocated-0": (7, 1500), "colocated-1": (2, 0)}
    b0 = b.router.engines["colocated-0"]
    assert (b0.num_inflight, b0.all_inflight, b0.all_queued_prefill_tokens) == (0, 7, 1500)
    assert load(b0) == 7 / 8
    assert b.router.pick_generator("colocated").engine_id == "colocated-1"
    assert b.router.pick_prefill() is None  # no prefill pool
    # a gateway publishes only its own counts: nothing goes round twice
    a.tick()
    assert peer_counts(a) == {"colocated-0": (1, 0), "colocated-1": (2, 0)}
    assert own_counts(b.router) == {}


def test_the_kv_aware_policy_leaves_a_holder_the_other_gateways_loaded(tmp_path):
    """A prefix held by colocated-0 goes there while it is quiet, and to
    colocated-1 once another gateway's queued prefills on colocated-0 outweigh it."""
    block, tokens = 16, list(range(64))
    hashes = hash_request_blocks(tokens, block)
    index = PrefixIndex()
    for eid in ENGINES:
        index.add_engine(eid, "colocated", 64)
    index.apply(KVEventBatch("colocated-0", 1, 1, 0.0, [BlockStored(hashes, None, block)]))
    clock = Clock()
    a, b = gateway(tmp_path, 0, clock), gateway(tmp_path, 1, clock)
    policy = RoutingPolicy(RoutingConfig(router="kv-aware"), b.router, index, "kv-aware")
    assert policy.choose("colocated", 64, hashes, block_size=block).engine.engine_id == (
        "colocated-0"
    )
    a.router.engines["colocated-0"].queued_prefill_tokens = 640  # ten prompts' worth
    a.tick(), b.tick()
    choice = policy.choose("colocated", 64, hashes, block_size=block)
    assert choice.engine.engine_id == "colocated-1" and choice.reason == "load"


def test_writes_on_change_and_on_heartbeat_only(tmp_path):
    clock = Clock()
    a = gateway(tmp_path, 0, clock)
    assert a.publish(clock()) and a.num_writes == 1  # the first tick always writes
    clock.now_s += 0.05
    assert not a.publish(clock())  # nothing changed
    a.router.engines["colocated-1"].num_inflight = 1
    assert a.publish(clock())
    clock.now_s += HEARTBEAT_S - 0.01
    assert not a.publish(clock())
    clock.now_s += 0.02
    assert a.publish(clock())  # the heartbeat: readers know a quiet gateway is alive
    with open(a.path(0), "rb") as f:
        record = decode_record(f.read())
    assert (record.index, record.pid, record.seq, record.time_s) == (0, os.getpid(), 3, clock())
    assert record.engines == {"colocated-1": (1, 0)}
    assert a.num_writes == 3


def test_a_dead_gateways_counts_expire_and_a_closed_ones_go_at_once(tmp_path):
    clock_a, clock_b = Clock(), Clock()
    a, b = gateway(tmp_path, 0, clock_a), gateway(tmp_path, 1, clock_b)
    c = gateway(tmp_path, 2, clock_a)
    a.router.engines["colocated-0"].num_inflight = 3
    c.router.engines["colocated-1"].num_inflight = 4
    a.tick(), c.tick()
    # a stops ticking (SIGKILL: its file stays); c keeps its heartbeat
    clock_b.now_s += EXPIRE_AFTER_S - 0.01
    clock_a.now_s = clock_b.now_s
    c.tick()
    b.tick()
    assert peer_counts(b) == {"colocated-0": (3, 0), "colocated-1": (4, 0)}
    clock_b.now_s += 0.02
    b.tick()
    assert peer_counts(b) == {"colocated-0": (0, 0), "colocated-1": (4, 0)}
    assert sorted(b.peers.records) == [2] and os.path.exists(a.path(0))
    # c exits cleanly: its file goes, and b drops it at its next tick
    c.close()
    assert not os.path.exists(c.path(2))
    b.tick()
    assert peer_counts(b) == {"colocated-0": (0, 0), "colocated-1": (0, 0)}


def test_a_torn_record_keeps_the_last_good_one_until_it_expires(tmp_path):
    clock = Clock()
    a, b = gateway(tmp_path, 0, clock), gateway(tmp_path, 1, clock)
    a.router.engines["colocated-0"].num_inflight = 3
    a.tick(), b.tick()
    good = (tmp_path / "load-0.json").read_bytes()
    a.router.engines["colocated-0"].num_inflight = 12  # a longer record, caught half written
    a.publish(clock())
    whole = (tmp_path / "load-0.json").read_bytes()
    assert len(whole) > len(good) and decode_record(whole).engines == {"colocated-0": (12, 0)}
    (tmp_path / "load-0.json").write_bytes(whole[: len(whole) - 3])
    b.tick()
    assert peer_counts(b)["colocated-0"] == (3, 0)
    (tmp_path / "load-0.json").write_bytes(whole[:8] + b"x" + whole[9:])  # payload changed
    b.tick()
    assert peer_counts(b)["colocated-0"] == (3, 0)
    (tmp_path / "load-0.json").write_bytes(b"")  # created, not written yet
    clock.now_s += EXPIRE_AFTER_S + 0.01
    b.tick()
    assert peer_counts(b)["colocated-0"] == (0, 0) and b.peers.records == {}
    # a shorter record over a longer one: the bytes past it are ignored
    a.router.engines["colocated-0"].num_inflight = 0
    (tmp_path / "load-0.json").write_bytes(whole)
    a2 = PeerLoadChannel(str(tmp_path), 0, a.router, clock=clock)
    a2.tick(), b.tick()
    assert len((tmp_path / "load-0.json").read_bytes()) == len(whole)
    assert sorted(b.peers.records) == [0] and peer_counts(b)["colocated-0"] == (0, 0)


def test_a_restarted_gateway_replaces_its_predecessors_counts(tmp_path):
    clock = Clock()
    a, b = gateway(tmp_path, 0, clock), gateway(tmp_path, 1, clock)
    a.router.engines["colocated-0"].num_inflight = 5
    a.tick(), b.tick()
    assert peer_counts(b)["colocated-0"] == (5, 0)
    clock.now_s += 0.5
    again = gateway(tmp_path, 0, clock)  # started again at the same index: nothing in flight
    again.tick(), b.tick()
    assert peer_counts(b)["colocated-0"] == (0, 0)


def test_records_merge_latest_per_gateway_and_expire():
    peers = PeerLoad(expire_after_s=2.0)
    peers.update(LoadRecord(1, 100, 10.0, 7, {"e": (2, 30)}))
    assert peers.totals(10.5) == {"e": (2, 30)}
    peers.update(LoadRecord(1, 200, 10.4, 1, {"e": (1, 0)}))  # the restarted gateway
    peers.update(LoadRecord(2, 300, 10.2, 1, {"e": (-4, 5), "f": (1, 1)}))  # negatives: 0
    assert peers.totals(10.5) == {"e": (1, 5), "f": (1, 1)}
    assert peers.totals(12.3) == {"e": (1, 0)}  # gateway 2's record expired
    assert sorted(peers.records) == [1]
    peers.drop(1)
    assert peers.totals(12.3) == {}
    with pytest.raises(ValueError, match="expire_after_s"):
        PeerLoad(expire_after_s=0)


def test_foreign_and_broken_files_are_ignored(tmp_path):
    clock = Clock()
    b = gateway(tmp_path, 1, clock)
    (tmp_path / "load-0.json").write_bytes(b"{not json")
    (tmp_path / "load-x.json").write_bytes(b"{}")
    (tmp_path / "load-2.json.123.tmp").write_bytes(b"{}")  # a writer killed mid-write
    bad = LoadRecord(5, 1, clock(), 1, {"colocated-0": (9, 9)})
    (tmp_path / "load-3.json").write_bytes(encode_record(bad))  # index does not match
    (tmp_path / "load-4.json").write_bytes(msgspec.json.encode(bad))  # no header
    (tmp_path / "gateway-0.json").write_bytes(b"{}")  # gateway_peers.py's figures
    b.tick()
    assert b.peers.records == {}
    assert peer_counts(b) == {"colocated-0": (0, 0), "colocated-1": (0, 0)}
    with pytest.raises(ValueError, match="interval_s"):
        PeerLoadChannel(str(tmp_path), 0, make_router(), interval_s=1.0, heartbeat_s=0.5)


def test_cluster_routing_shares_on_its_loop_and_stops_at_close(tmp_path):
    """``share_load`` as ``tandem serve`` calls it in each gateway: a timer
    chain on the running loop; ``close`` removes the gateway's record."""

    async def main() -> None:
        routers = [make_router(), make_router()]
        routings = [ClusterRouting(RoutingConfig(), r, {"colocated": 2}) for r in routers]
        routers[0].engines["colocated-1"].num_inflight = 2
        channels = [r.share_load(str(tmp_path), i) for i, r in enumerate(routings)]
        assert routings[0].share_load(str(tmp_path), 0) is channels[0]  # once
        deadline = asyncio.get_running_loop().time() + 30
        while routers[1].engines["colocated-1"].peer_inflight != 2:
            assert asyncio.get_running_loop().time() < deadline, "no shared count"
            await asyncio.sleep(0.01)
        routings[0].close()
        assert not os.path.exists(channels[0].path(0))
        while routers[1].engines["colocated-1"].peer_inflight != 0:
            assert asyncio.get_running_loop().time() < deadline, "the closed peer stays"
            await asyncio.sleep(0.01)
        routings[1].close()
        assert os.listdir(tmp_path) == []

    asyncio.run(main())
