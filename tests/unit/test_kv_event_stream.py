"""KV events over real ZMQ PUB/SUB with CURVE (scheduler/kv_events.py ->
cluster/routing/subscriber.py): a late subscriber and a lost batch both
end in a snapshot resync; a peer without the secret reads nothing."""

import asyncio

import zmq
import zmq.asyncio

from tandem.cluster.routing.index import PrefixIndex
from tandem.cluster.routing.subscriber import KVEventSubscriber
from tandem.wire.auth import PlaneAuth, generate_secret
from tandem.wire.frames import FrameCounters
from tandem.workers.engine.kv_events_publisher import KVEventPublisher
from tests.unit.kv_sim import SimEngine


async def _until(cond, timeout_s=20.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _work(eng: SimEngine, pub: KVEventPublisher, start: int, num: int, drop_seq=None) -> None:
    for i in range(start, start + num):
        eng.add(f"r{i}", [i % 3] * 8 + list(range(i * 20, i * 20 + 9)))
        eng.run_until_idle()
        for b in eng.take_batches():
            if b.seq != drop_seq:
                pub.publish(b)


def test_stream_syncs_index_with_resync_on_gap():
    secret = generate_secret()
    eng = SimEngine("d0", num_blocks=24)
    pub = KVEventPublisher("127.0.0.1", 0, secret, max_queued_batches=64)
    snapshots = []

    async def snapshot(engine_id):
        assert engine_id == "d0"
        snapshots.append(eng.snapshot())
        return snapshots[-1]

    async def main():
        ctx = zmq.asyncio.Context()
        auth = PlaneAuth(ctx, secret)
        index = PrefixIndex()
        index.add_engine("d0", "decode", 24)
        sub = KVEventSubscriber(ctx, auth, index, snapshot, FrameCounters())
        sub.connect("d0", pub.addr)
        task = asyncio.create_task(sub.run())
        try:
            # the first batches may reach no one (PUB slow joiner): resync
            for k in range(200):
                _work(eng, pub, k, 1)
                await asyncio.sleep(0.02)
                if index.hashes_of("d0") == eng.cached() and not index.engines["d0"].needs_resync:
                    break
            await _until(lambda: index.hashes_of("d0") == eng.cached())
            num_resyncs = index.num_resyncs
            # a lost batch: the next one reveals the gap, a snapshot repairs it
            next_seq = eng.events.seq + 1
            _work(eng, pub, 1000, 6, drop_seq=next_seq)
            await _until(lambda: index.num_resyncs > num_resyncs)
            await _until(lambda: index.hashes_of("d0") == eng.cached())
            assert index.num_gaps >= 1
            index.check_integrity()
        finally:
            task.cancel()
            sub.close()
            auth.close()
            ctx.term()

    try:
        asyncio.run(main())
    finally:
        pub.close()
    assert snapshots, "no resync happened"


def test_subscriber_without_secret_reads_nothing():
    secret = generate_secret()
    eng = SimEngine("d0")
    pub = KVEventPublisher("127.0.0.1", 0, secret)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(pub.addr)
        for k in range(20):
            _work(eng, pub, k, 1)
        assert eng.events.seq >= 1
        assert sock.poll(1000) == 0, "an unauthenticated subscriber got KV events"
    finally:
        sock.close()
        ctx.term()
        pub.close()
