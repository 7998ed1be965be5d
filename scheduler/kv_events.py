"""KV events: what an engine's prefix cache gained and lost, for the router.

    block pool --stored/removed/cleared--> KVEventRecorder (this step's events)
    engine loop, after each step: recorder.drain() -> one KVEventBatch
    KVEventPublisher: bounded queue -> ZMQ PUB  ==>  gateway SUB (cluster/kv_routing)

Field meaning follows vLLM's ``KVEventBatch``:

    BlockStored(block_hashes, parent_block_hash, num_tokens)
        full blocks just published in the prefix cache, in prompt order;
        ``parent_block_hash`` is the hash before the first of them (None at
        the start of a prompt), ``num_tokens`` = len(block_hashes) * block size.
    BlockRemoved(block_hashes)   evicted (their block was reused)
    AllBlocksCleared()           the whole cache was forgotten (reset)

A batch carries ``engine_id``, ``epoch`` (one per engine incarnation: a
restarted engine starts an empty cache under a new epoch) and ``seq``, which
counts batches from 1 within an epoch. A subscriber that sees ``seq`` jump
has lost batches (the publisher's queue overflowed, or the PUB socket
dropped them) and must resync from a snapshot: ``KVEventRecorder.snapshot``
answers ``(epoch, seq of the last batch drained, every cached hash)`` on the
engine loop thread, so batches with ``seq`` above it apply on top.

Events are off unless routing needs them: with no recorder attached the
block pool does nothing extra.
"""

from __future__ import annotations

import collections
import logging
import threading

import msgspec

from scheduler.block_hash import BlockHash

logger = logging.getLogger(__name__)


class BlockStored(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    num_tokens: int


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    engine_id: str
    epoch: int
    seq: int
    ts_s: float
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct, array_like=True):
    """Every hash the engine's cache holds after batch ``seq`` of ``epoch``."""

    engine_id: str
    epoch: int
    seq: int
    block_hashes: list[bytes]


class KVEventRecorder:
    """Collects one step's cache changes. Called by the block pool (engine
    loop thread only); ``drain`` turns them into the step's batch."""

    def __init__(self, engine_id: str, epoch: int, block_size: int) -> None:
        self.engine_id = engine_id
        self.epoch = epoch
        self.block_size = block_size
        self.seq = 0  # of the last batch drained
        self._events: list[KVEvent] = []
        self._removed: list[bytes] = []

    def stored(self, block_hashes: list[BlockHash], parent: BlockHash | None) -> None:
        if not block_hashes:
            return
        self._flush_removed()
        self._events.append(BlockStored(block_hashes, parent, len(block_hashes) * self.block_size))

    def removed(self, block_hash: BlockHash) -> None:
        self._removed.append(block_hash)  # evictions come one by one: merge them

    def cleared(self) -> None:
        self._removed.clear()
        self._events.append(AllBlocksCleared())

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(self._removed))
            self._removed = []

    def drain(self, ts_s: float) -> KVEventBatch | None:
        """This step's events as one batch (None if nothing changed)."""
        self._flush_removed()
        if not self._events:
            return None
        self.seq += 1
        batch = KVEventBatch(self.engine_id, self.epoch, self.seq, ts_s, self._events)
        self._events = []
        return batch

    def snapshot(self, cached_hashes: list[BlockHash]) -> KVSnapshot:
        """Call between steps (after ``drain``): the cache as of batch ``seq``."""
        assert not self._events and not self._removed, "snapshot with undrained events"
        return KVSnapshot(self.engine_id, self.epoch, self.seq, list(cached_hashes))


class KVEventPublisher:
    """ZMQ PUB of event batches behind a bounded queue, sent by its own
    thread so the engine loop never blocks. When the queue is full the
    oldest batch is dropped (counted): subscribers see the seq gap and
    resync. With a cluster ``secret`` the socket is a CURVE server
    (``wire.auth``), so only cluster members can subscribe. Binds at
    construction (``port`` 0: a free port); ``addr`` is where to connect."""

    def __init__(
        self, host: str, port: int, secret: bytes | None, max_queued_batches: int = 1024
    ) -> None:
        import zmq

        from wire.auth import PlaneAuth

        if max_queued_batches < 1:
            raise ValueError(f"kv_events_queue_batches must be >= 1, got {max_queued_batches}")
        self._ctx = zmq.Context()
        self._auth = PlaneAuth(self._ctx, secret)
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, max_queued_batches)
        self._auth.server(self._sock, "kv_events")
        self._sock.bind(f"tcp://{host}:{port or '*'}")
        self.addr: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: collections.deque[KVEventBatch] = collections.deque(maxlen=max_queued_batches)
        self._cond = threading.Condition()
        self._closed = False
        self.num_dropped_batches = 0
        self.num_sent_batches = 0
        self._enc = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        with self._cond:
            if len(self._queue) == self._queue.maxlen:
                self.num_dropped_batches += 1  # the deque drops the oldest
            self._queue.append(batch)
            self._cond.notify()

    def _run(self) -> None:
        import zmq

        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = self._queue.popleft()
            try:  # a PUB socket drops (never blocks) past its high-water mark
                self._sock.send_multipart([b"K", self._enc.encode(batch)], flags=zmq.NOBLOCK)
                self.num_sent_batches += 1
            except zmq.ZMQError:
                logger.exception("kv events: send failed")
                return

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._auth.close()
        self._ctx.term()
