"""ZMQ PUB side of the KV events (``scheduler/kv_events.py``): the engine
loop hands each step's batch to ``publish`` (never blocks); a sender thread
writes it to the PUB socket."""

from __future__ import annotations

import collections
import logging
import threading

import msgspec

from tandem.scheduler.kv_events import KVEventBatch
from tandem.wire.config_fields import default_of
from tandem.workers.config.sections import KVTransferSection

# --kv-events-queue-batches (the engine's kv_transfer section)
QUEUE_BATCHES: int = default_of(KVTransferSection, "kv_events_queue_batches")

logger = logging.getLogger(__name__)


class KVEventPublisher:
    """ZMQ PUB of event batches behind a bounded queue, sent by its own
    thread so the engine loop never blocks. When the queue is full the
    oldest batch is dropped (counted): subscribers see the seq gap and
    resync. With a cluster ``secret`` the socket is a CURVE server
    (``wire.auth``), so only cluster members can subscribe. Binds at
    construction (``port`` 0: a free port); ``addr`` is where to connect."""

    def __init__(
        self, host: str, port: int, secret: bytes | None, max_queued_batches: int = QUEUE_BATCHES
    ) -> None:
        import zmq

        from tandem.wire.auth import PlaneAuth

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
