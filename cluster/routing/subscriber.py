"""Gateway side of the KV event stream: one SUB socket connected to every
engine's PUB (``scheduler/kv_events.py``), feeding the ``PrefixIndex``.

    engine PUB (CURVE server) ==[b"K", KVEventBatch]==> gateway SUB (CURVE client)

A batch that reveals a gap (or a restart seen mid-stream) makes the reader
ask that engine for a snapshot (``snapshot(engine_id)``, a Ray control call)
and load it before reading on: batches that arrived meanwhile wait in the
socket and those the snapshot already covers are skipped by their seq.
Malformed messages are dropped and counted (``wire.frames``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from tandem.cluster.routing.index import PrefixIndex
from tandem.scheduler.kv_events import KVEventBatch, KVSnapshot
from tandem.wire.frames import FrameCounters, FrameSpec, MalformedFrame, MiB, peer_address

logger = logging.getLogger(__name__)

KV_EVENTS = FrameSpec("kv_events", {b"K": KVEventBatch}, max_frame_bytes=16 * MiB)


class KVEventSubscriber:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        auth: object,
        index: PrefixIndex,
        snapshot: Callable[[str], Awaitable[KVSnapshot]],
        malformed_frames: FrameCounters,
        snapshot_timeout_s: float = 10.0,
    ) -> None:
        """``auth``: the gateway's ``wire.auth.PlaneAuth`` (CURVE client)."""
        self.index = index
        self._snapshot = snapshot
        self.snapshot_timeout_s = snapshot_timeout_s
        self.malformed_frames = malformed_frames
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, KV_EVENTS.hard_limit)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"K")
        auth.client(self._sock)  # type: ignore[attr-defined]
        self._addrs: dict[str, str] = {}
        self.num_batches = 0
        self.num_resync_failures = 0

    def connect(self, engine_id: str, addr: str) -> None:
        """Follow ``engine_id`` at ``addr`` (a restarted engine has a new one)."""
        old = self._addrs.get(engine_id)
        if old == addr:
            return
        if old is not None:
            self._sock.disconnect(old)
        self._sock.connect(addr)
        self._addrs[engine_id] = addr

    def disconnect(self, engine_id: str) -> None:
        """Stop following ``engine_id`` (it left the cluster)."""
        addr = self._addrs.pop(engine_id, None)
        if addr is not None:
            self._sock.disconnect(addr)

    async def resync(self, engine_id: str) -> bool:
        try:
            snap = await asyncio.wait_for(self._snapshot(engine_id), self.snapshot_timeout_s)
        except Exception as exc:  # noqa: BLE001 - retried at the next batch
            self.num_resync_failures += 1
            logger.warning("kv events: snapshot of %s failed: %r", engine_id, exc)
            return False
        self.index.load_snapshot(snap)
        return True

    async def run(self) -> None:
        """Read forever (cancel to stop)."""
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                _, batch = KV_EVENTS.decode(frames)
            except MalformedFrame as e:
                self.malformed_frames.record(KV_EVENTS.socket, peer_address(frames), e)
                continue
            self.num_batches += 1
            if not self.index.apply(batch):
                if await self.resync(batch.engine_id):
                    self.index.apply(batch)  # skipped if the snapshot covers it

    def close(self) -> None:
        self._sock.close(linger=0)
