"""In-flight counts shared between gateways (``tandem serve --api-server-count N``).

Each gateway's router counts, per engine, the requests it sent there that
have not ended (``num_inflight``) and the predicted uncached prompt tokens
of those not yet prefilled (``queued_prefill_tokens``). The engines' stats
show every gateway's requests, but only as of the last health probe (every
0.5 s); until then a gateway does not see what the others just sent, and
several gateways routing a burst each pile onto the engine that looked
quiet (at 20x the routing trace's rate, 2-4 gateways lost 5-10 points of
hit rate that way: docs/benchmarks.md, #29). So each gateway sends its own
counts to the others when they change, and adds theirs to its own when it
scores engines:

    gateway i: its counters change (a request sent, its first output, its end)
      -> changed(): one flush at most every MIN_INTERVAL_S (batched)
      -> own = {engine: [num_inflight, queued_prefill_tokens]} (engines with work)
      -> one datagram [length u32][crc32 u32]{"index", "pid", "time_s", "seq",
         "engines": own, "closing"} to each peer's socket <dir>/load-<j>.sock
    gateway j: the socket is readable (its loop's reader)
      -> every datagram waiting; the latest per gateway replaces the one held
      -> EngineState.peer_inflight / peer_queued_prefill_tokens = the live peers' sums
    every HEARTBEAT_S: send even if unchanged, look for peers' sockets in <dir>,
      expire records older than EXPIRE_AFTER_S

The directory is the one the supervisor gives its gateways for their
figures (``cluster/observability/gateway_peers.py``): the gateways of one
command share a host, so Unix datagram sockets in it are the rendezvous,
and the wall clock is common ground. A gateway learns a peer from its
socket file (at start and each heartbeat) or from the peer's first
datagram, and answers a new peer with its own counts at once.

Why pushed, not polled: with the counts written to files and read by
every gateway on a timer, 50 ms between reads recovered only 22-47% of
the loss at 20x (a burst's requests arrive milliseconds apart), and
polling every 5 ms (which does recover it) costs each gateway about 100 us
per tick even when idle. A datagram per change, batched at
MIN_INTERVAL_S, costs nothing when idle and reaches the peers within the
batching delay plus a socket hop (well under a millisecond).

Every datagram carries the sender's whole state, so a lost one (a peer's
queue full: the send is retried at the next flush) costs only time, and
nothing needs ordering but "latest wins" (per sender pid, by ``seq``).

How stale: a peer's count is at most MIN_INTERVAL_S (5 ms) plus a socket
hop and one loop turn old, against the 0.5 s of the engines' stats.

Expiry: a record not refreshed for EXPIRE_AFTER_S (2 s, four heartbeats)
counts no more. Its gateway died, or its loop has stalled that long (a
clean exit sends a goodbye, ``closing``, so its peers forget it at once,
and removes its socket; a peer whose send to a gateway is refused drops
that gateway's counts at once). Shorter would drop a live gateway whose
loop pauses (a collection, a slow call); longer would keep a dead
gateway's claims in the load figure after the engines dropped its
requests. Nothing goes unseen meanwhile: the requests of a gateway that
died run on until the engines drop it (``--gateway-lost-after-s``) and the
engines' stats show them within a health interval, well inside 2 s. A
gateway started again at the same index sends its own (zero) counts at
start, which replace its predecessor's.

No I/O on the routing path: ``changed`` only schedules the flush; the
reader sets plain fields the policy reads.

What an operator sees (``stats``, read at each scrape of ``/metrics`` and
``/cluster/state``): the live peers with the age of their record, records
sent / received / expired, and datagrams lost by reason
(``gateway.backend.DROP_REASONS``); per engine the router's own and peer
counts (``observability/peer_load_metrics.py``, ``routing/metrics.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
import zlib
from collections.abc import Callable

import msgspec

from tandem.cluster.gateway.backend import DROP_REASONS, PeerGateway, PeerLoadStats
from tandem.cluster.routing.router import Router

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.005
HEARTBEAT_S = 0.5
EXPIRE_AFTER_S = 2.0  # checked at each datagram and heartbeat, so dropped within 2.5 s
PREFIX, SUFFIX = "load-", ".sock"
MAX_DATAGRAM_BYTES = 1 << 16  # ~30 bytes per engine with work: about 2,000 engines


class LoadRecord(msgspec.Struct):
    """One gateway's published counts: engine id -> [in flight, queued prefill tokens]."""

    index: int
    pid: int
    time_s: float  # wall clock at the write
    seq: int
    engines: dict[str, tuple[int, int]]
    closing: bool = False  # the sender's last word (a clean exit): forget it now


_DECODER = msgspec.json.Decoder(LoadRecord)
_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload


def encode_record(record: LoadRecord) -> bytes:
    payload = msgspec.json.encode(record)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def decode_record(data: bytes) -> LoadRecord | None:
    """A datagram's record; None when it is not one (cut short, its checksum
    wrong, or not a ``LoadRecord``: a stranger writing to the socket)."""
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
        self.num_expired = 0  # records forgotten for their age (not a goodbye, not a refusal)

    def update(self, record: LoadRecord) -> bool:
        """A record from peer ``record.index``: the latest wins (by ``seq`` for
        the same sender; a new pid is a restarted gateway, whose record
        replaces its predecessor's). Returns whether the sender is new (no
        record held, or another pid)."""
        held = self.records.get(record.index)
        if held is not None and held.pid == record.pid and record.seq <= held.seq:
            return False
        self.records[record.index] = record
        return held is None or held.pid != record.pid

    def drop(self, index: int) -> None:
        self.records.pop(index, None)

    def leave(self, record: LoadRecord) -> bool:
        """Peer ``record.index`` said goodbye: forget it, unless the record
        held is another process's (its successor already spoke). Returns
        whether it was forgotten."""
        held = self.records.get(record.index)
        if held is not None and held.pid != record.pid:
            return False
        self.drop(record.index)
        return True

    def live(self, now_s: float) -> list[LoadRecord]:
        """Records written within ``expire_after_s`` of ``now_s``; the others are forgotten."""
        for index in [i for i, r in self.records.items() if now_s - r.time_s > self.expire_after_s]:
            del self.records[index]
            self.num_expired += 1
        return list(self.records.values())

    def totals(self, now_s: float) -> dict[str, tuple[int, int]]:
        """Engine id -> the live peers' summed (in flight, queued prefill tokens);
        negative figures (a malformed record) count as 0."""
        self.live(now_s)
        return self.held_totals()

    def held_totals(self) -> dict[str, tuple[int, int]]:
        """``totals`` of the records held now, expiring none."""
        out: dict[str, tuple[int, int]] = {}
        for rec in self.records.values():
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
    """Gateway ``index``'s end of the shared counts, sockets in ``directory``
    (module doc). ``clock``: wall seconds, injectable (the benchmark runs it
    in simulated time). ``open`` / ``publish`` / ``receive`` / ``heartbeat``
    are the steps; ``start`` runs them on the event loop."""

    def __init__(
        self,
        directory: str,
        index: int,
        router: Router,
        *,
        min_interval_s: float = MIN_INTERVAL_S,
        heartbeat_s: float = HEARTBEAT_S,
        expire_after_s: float = EXPIRE_AFTER_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 <= min_interval_s < heartbeat_s < expire_after_s:
            raise ValueError(
                f"need 0 <= min_interval_s ({min_interval_s}) < heartbeat_s ({heartbeat_s}) "
                f"< expire_after_s ({expire_after_s})"
            )
        self.directory = directory
        self.index = index
        self.router = router
        self.min_interval_s, self.heartbeat_s = min_interval_s, heartbeat_s
        self.peers = PeerLoad(expire_after_s)
        self._clock = clock
        self._pid = os.getpid()
        self._seq = 0
        self._sock: socket.socket | None = None
        self._targets: dict[int, str] = {}  # peer index -> its socket path
        self._owed: set[int] = set()  # peers whose last send found their queue full
        self._last: dict[str, tuple[int, int]] | None = None
        self._last_send_s = float("-inf")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush: asyncio.TimerHandle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.num_sends = 0
        self.num_flushes = 0
        self.num_received = 0  # peers' records decoded (the latest of each counts)
        self.num_dropped = dict.fromkeys(DROP_REASONS, 0)

    def path(self, index: int) -> str:
        return os.path.join(self.directory, f"{PREFIX}{index}{SUFFIX}")

    def flush_at(self, now_s: float) -> float:
        """When a change made at ``now_s`` is sent: at most one flush per
        ``min_interval_s``."""
        return max(now_s, self._last_send_s + self.min_interval_s)

    @property
    def owes_peers(self) -> bool:
        """A peer's queue was full at the last send: flush again soon."""
        return bool(self._owed)

    def open(self) -> None:
        """Bind this gateway's socket (a predecessor's stale one is replaced)
        and find the peers' sockets."""
        path = self.path(self.index)
        if len(os.fsencode(path)) >= 108:  # sun_path
            raise ValueError(f"socket path too long for AF_UNIX: {path}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock.bind(path)
        self._sock = sock
        self.discover()

    def discover(self) -> None:
        """The peers' sockets now in the directory (new ones get our counts at
        the next send)."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
                continue
            try:
                index = int(name[len(PREFIX) : -len(SUFFIX)])
            except ValueError:
                continue
            if index != self.index and index not in self._targets:
                self._targets[index] = self.path(index)
                self._owed.add(index)

    def publish(self, now_s: float, force: bool = False) -> bool:
        """Send this gateway's counts to every peer when they changed (or
        ``force``: the heartbeat), and to peers owed the latest; True if sent."""
        counts = own_counts(self.router)
        changed = force or counts != self._last
        if changed:
            self._seq += 1
            self._last = counts
        to = set(self._targets) if changed else self._owed & set(self._targets)
        self._last_send_s = now_s
        self.num_flushes += 1
        if not to or self._sock is None:
            return False
        data = encode_record(LoadRecord(self.index, self._pid, now_s, self._seq, counts))
        self._owed.clear()
        num_refused = self.num_dropped["send_refused"]
        for index in sorted(to):
            try:
                self._sock.sendto(data, self._targets[index])
                self.num_sends += 1
            except BlockingIOError:  # its queue is full: it gets the latest at the next flush
                self._owed.add(index)
                self.num_dropped["queue_full"] += 1
            except OSError:  # gone (refused, removed): found again by its socket or datagram
                self.num_dropped["send_refused"] += 1
                self._targets.pop(index, None)
                self.peers.drop(index)
        if self.num_dropped["send_refused"] != num_refused:  # its counts leave the router now
            self.peers.apply(self.router, now_s)
        return True

    def receive(self, now_s: float) -> int:
        """Every datagram waiting; sets the router's peer counts. Returns how many."""
        if self._sock is None:
            return 0
        num = 0
        while True:
            try:
                data = self._sock.recv(MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            num += 1
            record = decode_record(data)
            if record is None or record.index == self.index:
                self.num_dropped["bad_datagram"] += 1
                continue
            self.num_received += 1
            if record.closing:  # its socket is going too: no send to it until it is back
                if self.peers.leave(record):
                    self._targets.pop(record.index, None)
                    self._owed.discard(record.index)
                continue
            if self.peers.update(record) or record.index not in self._targets:
                self._targets[record.index] = self.path(record.index)
                self._owed.add(record.index)  # a new peer: answer with our counts
        self.peers.apply(self.router, now_s)
        return num

    def heartbeat(self, now_s: float) -> None:
        """Look for new peers, send even if unchanged, expire silent peers."""
        self.discover()
        self.publish(now_s, force=True)
        self.peers.apply(self.router, now_s)

    def stats(self, now_s: float | None = None) -> PeerLoadStats:
        """What this gateway holds of its peers now (``/cluster/state``,
        ``/metrics``): the live ones with the age of their record, and the
        channel's counters. Expires what is due first and sets the router's
        peer counts to match, so the two never disagree."""
        now_s = self._clock() if now_s is None else now_s
        self.peers.apply(self.router, now_s)
        peers = [
            PeerGateway(
                index=r.index,
                pid=r.pid,
                age_s=max(now_s - r.time_s, 0.0),
                requests_in_flight=sum(max(n, 0) for n, _ in r.engines.values()),
            )
            for r in sorted(self.peers.records.values(), key=lambda r: r.index)
        ]
        return PeerLoadStats(
            gateway=self.index,
            expire_after_s=self.peers.expire_after_s,
            peers=peers,
            num_records_sent=self.num_sends,
            num_records_received=self.num_received,
            num_records_expired=self.peers.num_expired,
            num_dropped=dict(self.num_dropped),
        )

    def check_integrity(self) -> None:
        """Every step leaves the router's peer counts equal to the held
        records' sums (expiry happens at a step, never in between); no record
        or target is this gateway's own; a peer owed a send is a known one."""
        assert self.index not in self.peers.records, "a record of this gateway's own"
        assert self.index not in self._targets, "this gateway sends to itself"
        assert self._owed <= set(self._targets), f"owed unknown peers {self._owed}"
        held = self.peers.held_totals()
        for eid, st in self.router.engines.items():
            shown = (st.peer_inflight, st.peer_queued_prefill_tokens)
            assert shown == held.get(eid, (0, 0)), f"{eid}: router {shown}, records {held.get(eid)}"

    # ---- on the event loop ------------------------------------------------------

    def start(self) -> None:
        """Open, read on the running loop, heartbeat every ``heartbeat_s``."""
        if self._loop is not None:
            return
        self.open()
        self._loop = loop = asyncio.get_running_loop()
        assert self._sock is not None
        loop.add_reader(self._sock.fileno(), self._on_readable)
        self._beat()

    def changed(self) -> None:
        """The router's own counts changed: flush within ``min_interval_s``
        (one flush for every change meanwhile). A no-op before ``start``."""
        if self._loop is None or self._flush is not None:
            return
        now_s = self._clock()
        self._flush = self._loop.call_later(self.flush_at(now_s) - now_s, self._on_flush)

    def _on_flush(self) -> None:
        self._flush = None
        self._guarded(lambda: self.publish(self._clock()))
        if self.owes_peers and self._loop is not None:  # a full queue: try again
            self._flush = self._loop.call_later(max(self.min_interval_s, 0.001), self._on_flush)

    def _on_readable(self) -> None:
        self._guarded(lambda: self.receive(self._clock()))
        if self.owes_peers:  # a new peer: it gets our counts at once
            self.changed()

    def _beat(self) -> None:
        self._guarded(lambda: self.heartbeat(self._clock()))
        assert self._loop is not None
        self._timer = self._loop.call_later(self.heartbeat_s, self._beat)

    def _guarded(self, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception:  # noqa: BLE001 - the next step tries again
            logger.exception("sharing this gateway's in-flight counts failed")

    def close(self) -> None:
        """Stop, tell the others this gateway is leaving (they forget its
        counts and stop sending to it), close and remove its socket (a peer
        that missed the last word drops its counts at its next send to it,
        or after the expiry)."""
        for handle in (self._timer, self._flush):
            if handle is not None:
                handle.cancel()
        self._timer = self._flush = None
        if self._sock is not None:
            self._seq += 1
            goodbye = encode_record(
                LoadRecord(self.index, self._pid, self._clock(), self._seq, {}, closing=True)
            )
            for path in self._targets.values():
                try:
                    self._sock.sendto(goodbye, path)
                except OSError:
                    pass
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.path(self.index))
            except OSError:
                pass
        self._loop = None
        self.peers.records.clear()
        for st in self.router.engines.values():
            st.peer_inflight = st.peer_queued_prefill_tokens = 0
