"""An engine's output sockets: one per gateway that joined it.

Several gateways may serve one engine fleet (``tandem serve
--api-server-count N``, or gateways that ``--attach``). Each gateway binds
its own output PULL; the engine keeps one PUSH socket, with its own bounded
send queue (``output_sender.py``), per gateway, keyed by the gateway's
session (a ``time_ns`` taken at its start)::

    gateway A --EngineRequest(gateway=A)--> engine --outputs of A's requests--> A's PULL
    gateway B --EngineRequest(gateway=B)--> engine --outputs of B's requests--> B's PULL
                                                  --heartbeats-------------> every gateway

The return address travels with the request (``EngineRequest.gateway``):
the engine records the owner of each client request id and sends each
output only to it (no broadcast). ``gateway=0`` (a caller that names no
gateway) means the default gateway: the one the engine was started with
while it is registered, else the newest.

A gateway that is gone loses only its own requests. Each socket carries a
ZMQ monitor; a gateway whose connection is down (never came up, or dropped:
its process exited and its kernel closed the connection) for
``gateway_lost_after_s`` is dropped: its requests are aborted (their KV
freed), its held outputs discarded, its socket closed. While it is down its
held outputs do not pause the engine (the other gateways keep their
streams); once they fill its backlog it is dropped at once. A connected
gateway that reads nothing pauses the engine as before (backpressure), and
after ``output_stall_timeout_s`` its streams (only its own) are cut.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from tandem.workers.engine.output_sender import OutputSender

logger = logging.getLogger(__name__)
_monitor_ids = itertools.count()


@dataclass
class GatewayLink:
    """One gateway's output socket and what the engine knows of it."""

    session: int
    addr: str
    sender: OutputSender
    monitor: Any  # the socket monitor's PAIR socket
    connected: bool = False
    down_since_s: float = field(default_factory=time.monotonic)


class GatewayOutputs:
    """Loop thread only. ``make_socket()`` returns a PUSH socket already
    configured (HWM, linger, CURVE client); the addresses are connected here."""

    def __init__(
        self,
        make_socket: Callable[[], Any],
        backlog_messages: int,
        lost_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_socket = make_socket
        self._backlog_messages = backlog_messages
        self.lost_after_s = lost_after_s
        self._clock = clock
        self.links: dict[int, GatewayLink] = {}
        self.default_session: int | None = None  # the gateway the engine started with
        self.owners: dict[str, int] = {}  # client request id -> gateway session
        self.num_lost = 0  # gateways dropped because they were gone
        self.num_deferred_closed = 0  # deferred counts of links already closed
        # the sessions, replaced (never mutated) on change: other threads read it
        self.session_snapshot: tuple[int, ...] = ()

    # ---- membership --------------------------------------------------------

    def add(self, session: int, addr: str, *, default: bool = False) -> bool:
        """Register a gateway (idempotent for the same session and address);
        False when it was known already."""
        link = self.links.get(session)
        if link is not None and link.addr == addr:
            return False
        if link is not None:
            self.close(session)
        sock = self._make_socket()
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED,
            addr=f"inproc://tandem-gw-monitor-{next(_monitor_ids)}",
        )
        sock.connect(addr)
        self.links[session] = GatewayLink(
            session, addr, OutputSender(sock, self._backlog_messages, self._clock), monitor,
            down_since_s=self._clock(),
        )  # fmt: skip
        if default:
            self.default_session = session
        self.session_snapshot = tuple(sorted(self.links))
        return True

    def close(self, session: int) -> GatewayLink | None:
        """Forget a gateway: close its socket, drop what it was owed."""
        link = self.links.pop(session, None)
        if link is None:
            return None
        self.num_deferred_closed += link.sender.num_deferred
        link.sender.discard()
        try:
            link.sender.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        link.monitor.close(linger=0)
        link.sender.socket.close(linger=0)
        if self.default_session == session:
            self.default_session = None
        self.session_snapshot = tuple(sorted(self.links))
        for rid in [r for r, s in self.owners.items() if s == session]:
            del self.owners[rid]
        return link

    def close_all(self) -> None:
        for session in list(self.links):
            self.close(session)

    def sessions(self) -> list[int]:
        return sorted(self.links)

    # ---- ownership ---------------------------------------------------------

    def resolve(self, session: int) -> int | None:
        """The gateway that gets the outputs of a request naming ``session``."""
        if session in self.links:
            return session
        if session == 0:
            if self.default_session in self.links:
                return self.default_session
            return max(self.links) if self.links else None
        return None

    def own(self, request_id: str, session: int) -> int | None:
        owner = self.resolve(session)
        if owner is not None:
            self.owners[request_id] = owner
        return owner

    def requests_of(self, session: int) -> list[str]:
        return [rid for rid, s in self.owners.items() if s == session]

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.owners.pop(rid, None)

    def prune(self, live_ids: set[str]) -> None:
        """Drop the owners of requests that are no longer in the engine
        (finished or aborted); ``live_ids``: the client ids still there."""
        for rid in [r for r in self.owners if r not in live_ids]:
            del self.owners[rid]

    # ---- sending -------------------------------------------------------------

    def send(self, session: int | None, frames: list[bytes]) -> bool:
        link = self.links.get(session) if session is not None else None
        if link is None:
            return False
        link.sender.send(frames)
        return True

    def send_all_nowait(self, frames: list[bytes]) -> None:
        """Heartbeats: to every gateway, dropped where it would wait."""
        for link in self.links.values():
            try:
                link.sender.socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass

    def flush(self) -> bool:
        """Flush every gateway's backlog; True when no connected gateway is
        behind (a gateway that is down does not hold the engine back)."""
        ok = True
        for link in self.links.values():
            if not link.sender.flush() and link.connected:
                ok = False
        return ok

    @property
    def blocked(self) -> bool:
        return any(link.connected and link.sender.blocked for link in self.links.values())

    @property
    def full(self) -> bool:
        return any(link.connected and link.sender.full for link in self.links.values())

    def blocked_sockets(self) -> list[Any]:
        return [
            link.sender.socket
            for link in self.links.values()
            if link.connected and link.sender.blocked
        ]

    def stalled(self, timeout_s: float) -> list[GatewayLink]:
        return [link for link in self.links.values() if link.sender.stalled_s > timeout_s]

    # ---- liveness ---------------------------------------------------------------

    def poll_events(self) -> None:
        """Read the monitors' connect / disconnect events (never waits)."""
        for link in self.links.values():
            while link.monitor.poll(0):
                event = parse_monitor_message(link.monitor.recv_multipart())["event"]
                if event == zmq.EVENT_CONNECTED:
                    link.connected = True
                elif event == zmq.EVENT_DISCONNECTED and link.connected:
                    link.connected = False
                    link.down_since_s = self._clock()

    def lost(self) -> list[tuple[GatewayLink, str]]:
        """Gateways that are gone: down for ``lost_after_s``, or down with a full backlog."""
        now = self._clock()
        out = []
        for link in self.links.values():
            if link.connected:
                continue
            down_s = now - link.down_since_s
            if down_s >= self.lost_after_s:
                out.append((link, f"its connection was down for {down_s:.1f} s"))
            elif link.sender.full:
                out.append((link, "its connection is down and its backlog is full"))
        return out

    # ---- stats ---------------------------------------------------------------------

    @property
    def backlog_len(self) -> int:
        return sum(link.sender.backlog_len for link in self.links.values())

    @property
    def num_deferred(self) -> int:
        return self.num_deferred_closed + sum(
            link.sender.num_deferred for link in self.links.values()
        )

    def check_integrity(self, live_ids: set[str]) -> None:
        """Every request the engine holds has a registered owner."""
        for rid in live_ids:
            session = self.owners.get(rid)
            assert session is not None, f"request {rid} has no owning gateway"
            assert session in self.links, f"request {rid} owned by unknown gateway {session}"
