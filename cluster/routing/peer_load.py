"""In-flight counts shared between gateways (``tandem serve --api-server-count N``).

Each gateway's router counts, per engine, the requests it sent there that
have not ended (``num_inflight``) and the predicted uncached prompt tokens
of those not yet prefilled (``queued_prefill_tokens``). The engines' stats
show every gateway's requests, but only as of the last health probe (every
0.5 s); until then a gateway does not see what the others just sent, and
several gateways routing a burst each pile onto the engine that looked
quiet (at 20x the routing trace's rate, 2-4 gateways lost 6 points of hit
rate that way: docs/benchmarks.md, #29). So each gateway publishes its own
counts and adds the others' to its own when it scores engines:

    gateway i, every SHARE_INTERVAL_S on its loop (a timer chain):
      own = {engine: [num_inflight, queued_prefill_tokens]}   (engines with work only)
      changed since the last write, or HEARTBEAT_S since it
          -> <dir>/load-<i>.json: [length u32][crc32 u32] {"index", "pid", "time_s",
             "seq", "engines": own}   (one pwrite in place at offset 0)
      read every other load-<j>.json; drop records older than EXPIRE_AFTER_S
      EngineState.peer_inflight / peer_queued_prefill_tokens = the live records' sums

The directory is the one the supervisor gives its gateways for their
figures (``cluster/observability/gateway_peers.py``): the gateways of one
command share a host, so files and the wall clock are common ground.

Written in place, not renamed over: on this box's ext4 a rename over an
existing file costs 0.5-1.6 ms (the file system flushes the new data
first), 20 times a second on the gateway's loop, against ~10 us for a
pwrite. A reader that catches a write half done finds the CRC wrong and
keeps the record it had; the writer's next write (at most a heartbeat
later) mends it.

How stale: a peer's count is at most one interval old when it writes it
(its timer's phase) and read at most one interval later (ours): about
2 x SHARE_INTERVAL_S = 100 ms, against the 0.5 s of the engines' stats.

Expiry: a record not rewritten for EXPIRE_AFTER_S (2 s, four heartbeats)
counts no more. Its gateway died (a clean exit removes its file at once) or
its loop has stalled that long. Shorter would drop a live gateway whose
loop pauses (a collection, a slow call); longer would keep a dead
gateway's claims in the load figure after the engines dropped its
requests. Nothing goes unseen meanwhile: the requests of a gateway that
died run on until the engines drop it (``--gateway-lost-after-s``) and the
engines' stats show them within a health interval, well inside 2 s. A
gateway started again at the same index replaces its predecessor's record
with its own (zero) counts at its first tick.

No I/O on the routing path: ``tick`` runs on the timer and sets plain
fields the policy reads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
import zlib
from collections.abc import Callable

import msgspec

from tandem.cluster.routing.router import Router

logger = logging.getLogger(__name__)

SHARE_INTERVAL_S = 0.05
HEARTBEAT_S = 0.5
EXPIRE_AFTER_S = 2.0
PREFIX, SUFFIX = "load-", ".json"


class LoadRecord(msgspec.Struct):
    """One gateway's published counts: engine id -> [in flight, queued prefill tokens]."""

    index: int
    pid: int
    time_s: float  # wall clock at the write
    seq: int
    engines: dict[str, tuple[int, int]]


_DECODER = msgspec.json.Decoder(LoadRecord)
_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload


def encode_record(record: LoadRecord) -> bytes:
    payload = msgspec.json.encode(record)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def decode_record(data: bytes) -> LoadRecord | None:
    """A file's record; None when it is torn (a write half done), cut short
    or not a record (bytes past the payload are an older, longer write's)."""
    if len(data) < _HEADER.size:
        return None
    length, crc = _HEADER.unpack_from(data)
    payload = data[_HEADER.size : _HEADER.size + length]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def own_counts(router: Router) -> dict[str, tuple[int, int]]:
    """This gateway's own counts, engines with work only (``peer_*`` never:
    a gateway publishes what it sent, so no count goes round twice)."""
    return {
        eid: (st.num_inflight, st.queued_prefill_tokens)
        for eid, st in router.engines.items()
        if st.num_inflight or st.queued_prefill_tokens
    }


class PeerLoad:
    """The other gateways' latest records: merge and expiry (no I/O)."""

    def __init__(self, expire_after_s: float = EXPIRE_AFTER_S) -> None:
        if not expire_after_s > 0:
            raise ValueError(f"expire_after_s must be > 0, got {expire_after_s}")
        self.expire_after_s = expire_after_s
        self.records: dict[int, LoadRecord] = {}

    def update(self, record: LoadRecord) -> None:
        """The record just read from peer ``record.index``'s file: it replaces
        the one held (files are replaced whole, so what a reader finds is the
        writer's latest; a restarted gateway's replaces its predecessor's)."""
        self.records[record.index] = record

    def drop(self, index: int) -> None:
        self.records.pop(index, None)

    def live(self, now_s: float) -> list[LoadRecord]:
        """Records written within ``expire_after_s`` of ``now_s``; the others are forgotten."""
        for index in [i for i, r in self.records.items() if now_s - r.time_s > self.expire_after_s]:
            del self.records[index]
        return list(self.records.values())

    def totals(self, now_s: float) -> dict[str, tuple[int, int]]:
        """Engine id -> the live peers' summed (in flight, queued prefill tokens);
        negative figures (a malformed record) count as 0."""
        out: dict[str, tuple[int, int]] = {}
        for rec in self.live(now_s):
            for eid, (num_inflight, num_queued) in rec.engines.items():
                a, b = out.get(eid, (0, 0))
                out[eid] = (a + max(num_inflight, 0), b + max(num_queued, 0))
        return out

    def apply(self, router: Router, now_s: float) -> None:
        """Set every engine's ``peer_*`` fields to the live peers' sums
        (engines no peer names: 0; names the router lacks: ignored)."""
        totals = self.totals(now_s)
        for eid, st in router.engines.items():
            st.peer_inflight, st.peer_queued_prefill_tokens = totals.get(eid, (0, 0))


class PeerLoadChannel:
    """Gateway ``index``'s end of the shared counts in ``directory`` (module doc).
    ``clock``: wall seconds, injectable (the benchmark runs it in simulated time)."""

    def __init__(
        self,
        directory: str,
        index: int,
        router: Router,
        *,
        interval_s: float = SHARE_INTERVAL_S,
        heartbeat_s: float = HEARTBEAT_S,
        expire_after_s: float = EXPIRE_AFTER_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < interval_s <= heartbeat_s < expire_after_s:
            raise ValueError(
                f"need 0 < interval_s ({interval_s}) <= heartbeat_s ({heartbeat_s}) "
                f"< expire_after_s ({expire_after_s})"
            )
        self.directory = directory
        self.index = index
        self.router = router
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self.peers = PeerLoad(expire_after_s)
        self._clock = clock
        self._pid = os.getpid()
        self._seq = 0
        self._last: dict[str, tuple[int, int]] | None = None
        self._last_write_s = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self._fd: int | None = None  # this gateway's record file, kept open
        self.num_writes = 0

    def path(self, index: int) -> str:
        return os.path.join(self.directory, f"{PREFIX}{index}{SUFFIX}")

    def publish(self, now_s: float) -> bool:
        """Write this gateway's counts when they changed or a heartbeat is due."""
        counts = own_counts(self.router)
        if counts == self._last and now_s - self._last_write_s < self.heartbeat_s:
            return False
        self._seq += 1
        record = LoadRecord(self.index, self._pid, now_s, self._seq, counts)
        if self._fd is None:
            self._fd = os.open(self.path(self.index), os.O_WRONLY | os.O_CREAT, 0o600)
        os.pwrite(self._fd, encode_record(record), 0)
        self._last, self._last_write_s = counts, now_s
        self.num_writes += 1
        return True

    def read(self) -> None:
        """Every other gateway's latest record; a file gone drops its gateway."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            names = []
        seen = set()
        for name in names:
            if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
                continue
            try:
                index = int(name[len(PREFIX) : -len(SUFFIX)])
            except ValueError:
                continue
            if index == self.index:
                continue
            data = _read_file(f"{self.directory}/{name}")
            if data is None:
                continue  # removed meanwhile
            seen.add(index)
            record = decode_record(data)
            if record is not None and record.index == index:
                self.peers.update(record)  # else torn or foreign: keep what we had
        for index in [i for i in self.peers.records if i not in seen]:
            self.peers.drop(index)

    def tick(self) -> None:
        """Publish, read, and set the router's peer counts (one timer step)."""
        now_s = self._clock()
        self.publish(now_s)
        self.read()
        self.peers.apply(self.router, now_s)

    def start(self) -> None:
        """Tick now and every ``interval_s`` on the running loop (a timer chain,
        like ``GatewayPeers``; ``close`` ends it)."""
        if self._timer is not None:
            return
        self._tick(asyncio.get_running_loop())

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.tick()
        except Exception:  # noqa: BLE001 - the next tick tries again
            logger.exception("sharing this gateway's in-flight counts failed")
        self._timer = loop.call_later(self.interval_s, self._tick, loop)

    def close(self) -> None:
        """Stop ticking and remove this gateway's record: the others drop its
        counts at their next tick instead of after the expiry."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.path(self.index))
        except OSError:
            pass
        for st in self.router.engines.values():
            st.peer_inflight = st.peer_queued_prefill_tokens = 0


def _read_file(path: str) -> bytes | None:
    """The whole file (unbuffered: a few small reads per tick), None if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
