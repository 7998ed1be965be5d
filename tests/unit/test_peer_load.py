"""In-flight counts shared between gateways (``cluster/routing/peer_load.py``):
real ``PeerLoadChannel``s (Unix datagram sockets in one directory), each
with its own router, as the gateways of ``--api-server-count`` run them;
clocks injected, no Ray."""

from __future__ import annotations

import asyncio
import os
import socket

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from tandem.cluster.observability.peer_load_metrics import peer_load_families
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


@pytest.fixture
def share_dir(tmp_path_factory):
    # AF_UNIX paths are short (108 bytes): a short directory, not pytest's tmp_path
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pl-") as d:
        yield d


@pytest.fixture
def gateways(share_dir):
    """``make(index, clock)``: an open channel; all closed at the end. With
    ``meet`` every channel made so far looks for the others' sockets (as its
    heartbeat does)."""
    made: list[PeerLoadChannel] = []

    def make(index: int, clock: Clock, meet: bool = True) -> PeerLoadChannel:
        ch = PeerLoadChannel(share_dir, index, make_router(), clock=clock)
        ch.open()
        made.append(ch)
        if meet:
            for other in made:
                other.discover()
        return ch

    yield make
    for ch in made:
        ch.check_integrity()  # after every scenario: the router's counts are the records'
        ch.close()
        ch.check_integrity()


def peer_counts(ch: PeerLoadChannel) -> dict[str, tuple[int, int]]:
    return {
        eid: (st.peer_inflight, st.peer_queued_prefill_tokens)
        for eid, st in ch.router.engines.items()
    }


def test_each_gateway_scores_with_the_others_counts_added(gateways):
    clock = Clock()
    a, b, c = (gateways(i, clock) for i in range(3))
    a0 = a.router.engines["colocated-0"]
    a0.num_inflight, a0.queued_prefill_tokens = 6, 1500
    c.router.engines["colocated-0"].num_inflight = 1
    c.router.engines["colocated-1"].num_inflight = 2
    # without the others' counts, b sees two idle engines and picks the first by id
    assert b.router.pick_generator("colocated").engine_id == "colocated-0"
    assert a.publish(clock()) and c.publish(clock())
    assert b.receive(clock()) == 2
    assert peer_counts(b) == {"colocated-0": (7, 1500), "colocated-1": (2, 0)}
    b0 = b.router.engines["colocated-0"]
    assert (b0.num_inflight, b0.all_inflight, b0.all_queued_prefill_tokens) == (0, 7, 1500)
    assert load(b0) == 7 / 8
    assert b.router.pick_generator("colocated").engine_id == "colocated-1"
    # a gateway sends only its own counts: nothing goes round twice
    assert own_counts(b.router) == {}
    b.publish(clock())  # first send: its (empty) counts
    a.receive(clock())
    assert peer_counts(a) == {"colocated-0": (1, 0), "colocated-1": (2, 0)}


def test_the_kv_aware_policy_leaves_a_holder_the_other_gateways_loaded(gateways):
    """A prefix held by colocated-0 goes there while it is quiet, and to
    colocated-1 once another gateway's queued prefills on colocated-0 outweigh it."""
    block, tokens = 16, list(range(64))
    hashes = hash_request_blocks(tokens, block)
    index = PrefixIndex()
    for eid in ENGINES:
        index.add_engine(eid, "colocated", 64)
    index.apply(KVEventBatch("colocated-0", 1, 1, 0.0, [BlockStored(hashes, None, block)]))
    clock = Clock()
    a, b = gateways(0, clock), gateways(1, clock)
    policy = RoutingPolicy(RoutingConfig(router="kv-aware"), b.router, index, "kv-aware")
    choice = policy.choose("colocated", 64, hashes, block_size=block)
    assert choice.engine.engine_id == "colocated-0" and choice.reason == "prefix_hit"
    a.router.engines["colocated-0"].queued_prefill_tokens = 640  # ten prompts' worth
    a.publish(clock()), b.receive(clock())
    choice = policy.choose("colocated", 64, hashes, block_size=block)
    assert choice.engine.engine_id == "colocated-1" and choice.reason == "load"


def test_sends_on_change_owed_peers_and_heartbeats_only(gateways):
    clock = Clock()
    a, b = gateways(0, clock), gateways(1, clock)
    assert a.publish(clock()) and a.num_sends == 1  # the first send always goes
    assert a.flush_at(clock()) == clock() + a.min_interval_s  # batched
    clock.now_s += 0.05
    assert not a.publish(clock())  # nothing changed, nobody owed
    a.router.engines["colocated-1"].num_inflight = 1
    assert a.publish(clock()) and a.num_sends == 2
    clock.now_s += HEARTBEAT_S
    a.heartbeat(clock())  # even unchanged: the others know a quiet gateway is alive
    assert a.num_sends == 3
    assert b.receive(clock()) == 3
    record = b.peers.records[0]
    assert (record.index, record.pid, record.seq, record.time_s) == (0, os.getpid(), 3, clock())
    assert record.engines == {"colocated-1": (1, 0)}


def test_a_peer_that_joins_later_is_answered_at_once(gateways):
    clock = Clock()
    a = gateways(0, clock)
    a.router.engines["colocated-0"].num_inflight = 2
    assert not a.publish(clock())  # nobody to send to
    b = gateways(1, clock, meet=False)  # finds a's socket; a has not looked since
    b.publish(clock())
    a.receive(clock())  # learns b from its datagram and owes it its counts
    assert a.owes_peers and a.publish(clock())  # unchanged, but b is new
    b.receive(clock())
    assert peer_counts(b)["colocated-0"] == (2, 0)


def test_a_full_queue_is_owed_the_latest_counts(gateways):
    clock = Clock()
    a, b = gateways(0, clock), gateways(1, clock)
    a0 = a.router.engines["colocated-0"]
    for n in range(1, 10_000):  # b does not read: its queue fills (net.unix.max_dgram_qlen)
        a0.num_inflight = n
        a.publish(clock())
        if a.owes_peers:
            break
    assert a.owes_peers, "b's queue never filled"
    assert a.num_dropped == {"bad_datagram": 0, "send_refused": 0, "queue_full": 1}
    b.receive(clock())
    assert peer_counts(b)["colocated-0"] == (n - 1, 0)  # the last one that got through
    assert a.publish(clock()) and not a.owes_peers  # unchanged, sent to the owed peer
    b.receive(clock())
    assert peer_counts(b)["colocated-0"] == (n, 0)


def test_a_dead_gateways_counts_expire_and_a_closed_ones_go_at_once(gateways):
    clock_a, clock_b = Clock(), Clock()
    a, b, c = gateways(0, clock_a), gateways(1, clock_b), gateways(2, clock_a)
    a.router.engines["colocated-0"].num_inflight = 3
    c.router.engines["colocated-1"].num_inflight = 4
    a.publish(clock_a()), c.publish(clock_a())
    # a goes silent (SIGKILL: its socket file stays); c keeps its heartbeat
    clock_b.now_s += EXPIRE_AFTER_S - 0.01
    clock_a.now_s = clock_b.now_s
    c.heartbeat(clock_a())
    b.receive(clock_b())
    assert peer_counts(b) == {"colocated-0": (3, 0), "colocated-1": (4, 0)}
    clock_b.now_s += 0.02
    b.heartbeat(clock_b())
    assert peer_counts(b) == {"colocated-0": (0, 0), "colocated-1": (4, 0)}
    assert sorted(b.peers.records) == [2]
    # c exits cleanly: its last word is a goodbye, its socket goes
    c.close()
    assert not os.path.exists(c.path(2))
    b.receive(clock_b())
    assert peer_counts(b) == {"colocated-0": (0, 0), "colocated-1": (0, 0)}
    assert b.peers.records == {} and 2 not in b._targets  # forgotten, not sent to
    b.router.engines["colocated-0"].num_inflight = 1
    b.publish(clock_b())
    assert b.num_dropped["send_refused"] == 0  # nothing sent to c's removed socket


def test_a_send_refused_drops_the_peers_counts(gateways):
    clock = Clock()
    a, b = gateways(0, clock), gateways(1, clock)
    a.router.engines["colocated-0"].num_inflight = 5
    a.publish(clock()), b.receive(clock())
    assert peer_counts(b)["colocated-0"] == (5, 0)
    a._sock.close()  # a dies with its socket file left behind (SIGKILL)
    a._sock = None
    b.router.engines["colocated-1"].num_inflight = 1
    b.publish(clock())  # refused: nobody reads that socket; a's counts go at once
    assert peer_counts(b)["colocated-0"] == (0, 0) and b.peers.records == {}


def test_a_restarted_gateway_replaces_its_predecessors_counts(gateways, monkeypatch):
    clock = Clock()
    a, b = gateways(0, clock), gateways(1, clock)
    a.router.engines["colocated-0"].num_inflight = 5
    for _ in range(3):
        a.router.engines["colocated-0"].num_inflight += 1
        a.publish(clock())
    b.receive(clock())
    assert peer_counts(b)["colocated-0"] == (8, 0) and b.peers.records[0].seq == 3
    monkeypatch.setattr(os, "getpid", lambda: 424242)  # a new process, same index
    again = gateways(0, clock)  # replaces a's stale socket; nothing in flight
    again.publish(clock())
    b.receive(clock())
    assert peer_counts(b)["colocated-0"] == (0, 0) and b.peers.records[0].seq == 1


def test_records_merge_latest_per_gateway_and_expire():
    peers = PeerLoad(expire_after_s=2.0)
    assert peers.update(LoadRecord(1, 100, 10.0, 7, {"e": (2, 30)}))  # a new sender
    assert not peers.update(LoadRecord(1, 100, 10.1, 6, {"e": (9, 9)}))  # older seq: ignored
    assert peers.totals(10.5) == {"e": (2, 30)}
    assert peers.update(LoadRecord(1, 200, 10.4, 1, {"e": (1, 0)}))  # restarted: new pid
    peers.update(LoadRecord(2, 300, 10.2, 1, {"e": (-4, 5), "f": (1, 1)}))  # negatives: 0
    assert peers.totals(10.5) == {"e": (1, 5), "f": (1, 1)}
    assert peers.totals(12.3) == {"e": (1, 0)}  # gateway 2's record expired
    assert sorted(peers.records) == [1]
    peers.drop(1)
    assert peers.totals(12.3) == {}
    with pytest.raises(ValueError, match="expire_after_s"):
        PeerLoad(expire_after_s=0)


def test_foreign_and_broken_datagrams_are_ignored(gateways, share_dir):
    clock = Clock()
    b = gateways(1, clock)
    record = encode_record(LoadRecord(0, 1, clock(), 1, {"colocated-0": (9, 9)}))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for data in (
            b"{not a record",
            msgspec.json.encode(LoadRecord(0, 1, clock(), 1, {})),  # no header
            record[:-3],  # cut short
            record[:8] + b"x" + record[9:],  # payload changed: CRC
            encode_record(LoadRecord(1, 1, clock(), 1, {"colocated-0": (9, 9)})),  # b's own
        ):
            s.sendto(data, b.path(1))
    open(os.path.join(share_dir, "load-x.sock"), "w").close()  # not a gateway's socket
    assert b.receive(clock()) == 5
    assert b.peers.records == {}
    assert peer_counts(b) == {"colocated-0": (0, 0), "colocated-1": (0, 0)}
    b.discover()
    assert b._targets == {}
    assert decode_record(record).engines == {"colocated-0": (9, 9)}
    with pytest.raises(ValueError, match="min_interval_s"):
        PeerLoadChannel(share_dir, 0, make_router(), min_interval_s=1.0, heartbeat_s=0.5)
    with pytest.raises(ValueError, match="too long"):
        PeerLoadChannel("/tmp/" + "d" * 120, 0, make_router()).open()


def test_cluster_routing_shares_on_its_loop_and_stops_at_close(share_dir, tmp_path):
    """``share_load`` as ``tandem serve`` calls it in each gateway: the reader
    on the running loop, ``load_changed`` batched into one flush, ``close``
    tells the others and removes the socket."""

    async def main() -> None:
        routers = [make_router(), make_router()]
        routings = [ClusterRouting(RoutingConfig(), r, {"colocated": 2}) for r in routers]
        channels = [r.share_load(share_dir, i) for i, r in enumerate(routings)]
        assert routings[0].share_load(share_dir, 0) is channels[0]  # once
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30

        async def until(cond, what: str) -> None:
            while not cond():
                assert loop.time() < deadline, what
                await asyncio.sleep(0.005)

        flushes = channels[0].num_flushes
        for _ in range(5):  # five changes in one loop turn: one flush
            routers[0].engines["colocated-1"].num_inflight += 1
            routings[0].load_changed()
        await until(lambda: routers[1].engines["colocated-1"].peer_inflight == 5, "no count")
        assert channels[0].num_flushes == flushes + 1
        for ch in channels:
            ch.check_integrity()
        routings[0].close()
        assert not os.path.exists(channels[0].path(0))
        await until(lambda: routers[1].engines["colocated-1"].peer_inflight == 0, "no goodbye")
        routings[1].close()
        assert os.listdir(share_dir) == []
        # a directory whose socket path cannot be bound: logged, not shared
        far = ClusterRouting(RoutingConfig(), make_router(), {"colocated": 2})
        assert far.share_load(str(tmp_path / ("d" * 120)), 0) is None
        far.load_changed()  # a no-op
        far.close()

    asyncio.run(main())


def exposed(stats) -> dict[tuple[str, tuple], float]:
    """``peer_load_families(stats)`` as a scrape parses them: (sample name,
    labels) -> value."""

    class One(Collector):
        def collect(self):
            return peer_load_families(stats)

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.name.endswith("_created")
    }


def dropped(reason: str) -> tuple[str, tuple]:
    return ("tandem:peer_load_dropped_total", (("reason", reason),))


def test_live_peers_their_age_and_expiry_as_the_metrics_show_them(gateways):
    """b's view of a and c over real sockets: the live peers and their
    record's age, a silent peer's expiry (counted, and the router's counts
    follow at the same read), a bad datagram and a refused send."""
    clock = Clock()
    a, b, c = (gateways(i, clock) for i in range(3))
    a.router.engines["colocated-0"].num_inflight = 3
    c.router.engines["colocated-1"].num_inflight = 2
    a.publish(clock()), c.publish(clock())
    assert b.receive(clock()) == 2
    stats = b.stats(clock())
    assert stats.gateway == 1 and stats.expire_after_s == EXPIRE_AFTER_S
    assert [(p.index, p.pid, p.age_s, p.requests_in_flight) for p in stats.peers] == [
        (0, os.getpid(), 0.0, 3),
        (2, os.getpid(), 0.0, 2),
    ]
    assert (stats.num_records_received, stats.num_records_expired) == (2, 0)
    clock.now_s += 1.5
    c.heartbeat(clock())  # c stays; a has gone silent (SIGKILL)
    b.receive(clock())
    m = exposed(b.stats(clock()))
    assert m[("tandem:peer_gateways_live", ())] == 2
    assert m[("tandem:peer_load_oldest_record_age_seconds", ())] == pytest.approx(1.5)
    assert m[("tandem:peer_load_records_received_total", ())] == 3
    clock.now_s += 0.6  # a's record is 2.1 s old: expired at this read, with no datagram
    assert peer_counts(b)["colocated-0"] == (3, 0)  # until the read
    stats = b.stats(clock())
    assert [p.index for p in stats.peers] == [2] and stats.num_records_expired == 1
    assert peer_counts(b) == {"colocated-0": (0, 0), "colocated-1": (2, 0)}
    m = exposed(stats)
    assert m[("tandem:peer_gateways_live", ())] == 1
    assert m[("tandem:peer_load_oldest_record_age_seconds", ())] == pytest.approx(0.6)
    assert m[("tandem:peer_load_records_expired_total", ())] == 1
    assert m[dropped("bad_datagram")] == m[dropped("send_refused")] == 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"not a record", b.path(1))
    b.receive(clock())
    # c dies with its socket file left: b's next send there is refused, c forgotten
    c._sock.close()
    c._sock = None
    b.router.engines["colocated-1"].num_inflight = 1
    b.publish(clock())
    m = exposed(b.stats(clock()))
    assert m[dropped("bad_datagram")] == 1 and m[dropped("send_refused")] == 1
    assert m[dropped("queue_full")] == 0
    assert m[("tandem:peer_gateways_live", ())] == 0
    assert m[("tandem:peer_load_oldest_record_age_seconds", ())] == 0
    assert m[("tandem:peer_load_records_sent_total", ())] == b.num_sends == 1  # to a's file
    assert peer_counts(b) == {"colocated-0": (0, 0), "colocated-1": (0, 0)}


def test_a_lone_gateway_exposes_the_families_at_zero():
    m = exposed(None)
    assert m == {
        ("tandem:peer_gateways_live", ()): 0,
        ("tandem:peer_load_oldest_record_age_seconds", ()): 0,
        ("tandem:peer_load_records_sent_total", ()): 0,
        ("tandem:peer_load_records_received_total", ()): 0,
        ("tandem:peer_load_records_expired_total", ()): 0,
        **{dropped(r): 0 for r in ("bad_datagram", "queue_full", "send_refused")},
    }
