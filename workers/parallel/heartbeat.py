"""Worker heartbeats: telling a stopped or wedged rank from a slow one.

    worker r: a daemon thread, PUSH --> rank 0: one PULL per worker rank
              WorkerReply(REPLY_HEARTBEAT, r, sent_s=time.monotonic()) every interval
    rank 0:   HeartbeatBook.stale(): ranks that sent nothing for ``stale_after_s``

Both ends are conflated (ZMQ_CONFLATE): a socket keeps only the newest beat,
so a rank 0 that read nothing for an hour (an idle offline engine) finds the
beat sent last, never a backlog of old ones, and memory stays one message.

A process stopped by SIGSTOP (or frozen by its host) runs none of its
threads, so its beats stop; a live rank waiting in a collective keeps
beating. Rank 0 reads the sockets only between its own collectives, so what
counts is when a beat was *sent* (``sent_s``), not when it was read: both
clocks are ``CLOCK_MONOTONIC`` of the same host (a TP engine's ranks share
one node: local processes, or Ray actors in a STRICT_PACK group).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec

from tandem.workers.parallel.messages import REPLY_HEARTBEAT, WorkerReply

MAX_INTERVAL_S = 1.0


def heartbeat_interval_s(step_timeout_s: float) -> float:
    """How often a worker beats: ten beats per step deadline, at most one a second."""
    return min(MAX_INTERVAL_S, step_timeout_s / 10)


class HeartbeatSender:
    """A worker's heartbeat thread (``start``/``stop``; ``stop`` joins it).

    It owns its socket (ZMQ sockets are not shared between threads) and
    closes it on stop; the context is the worker's."""

    def __init__(self, ctx: Any, addr: str, rank: int, interval_s: float) -> None:
        self.rank = rank
        self.interval_s = interval_s
        self._ctx = ctx
        self._addr = addr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tp-heartbeat-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        import zmq

        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CONFLATE, 1)
        sock.connect(self._addr)
        enc = msgspec.msgpack.Encoder()
        try:
            while not self._stop.is_set():
                beat = WorkerReply(REPLY_HEARTBEAT, self.rank, sent_s=time.monotonic())
                sock.send(enc.encode(beat), flags=zmq.NOBLOCK)  # conflated: never full
                self._stop.wait(self.interval_s)
        finally:
            sock.close()


class HeartbeatBook:
    """Rank 0's side: a conflated PULL per worker rank (``addrs[rank]`` goes
    in that rank's ``WorkerSpec``) and the last beat each rank sent.

    A rank counts as heard at ``restart_clock`` (the executor calls it when
    every worker is ready: before that, loading may starve the beats);
    ``stale`` reads the sockets first. ``close`` before the context ends.
    """

    def __init__(self, ctx: Any, host: str, ranks: list[int], stale_after_s: float) -> None:
        import zmq

        self.stale_after_s = stale_after_s
        self.last_sent_s = dict.fromkeys(ranks, time.monotonic())
        self._dec = msgspec.msgpack.Decoder(WorkerReply)
        self._socks: dict[int, Any] = {}
        self.addrs: dict[int, str] = {}
        for rank in ranks:
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.CONFLATE, 1)
            port = sock.bind_to_random_port(f"tcp://{host}")
            self._socks[rank] = sock
            self.addrs[rank] = f"tcp://{host}:{port}"

    def restart_clock(self) -> None:
        """Every rank counts as just heard."""
        now_s = time.monotonic()
        for rank in self.last_sent_s:
            self.last_sent_s[rank] = max(self.last_sent_s[rank], now_s)

    def read(self) -> None:
        """Take the newest beat waiting on each socket (non-blocking)."""
        import zmq

        for rank, sock in self._socks.items():
            try:
                beat = self._dec.decode(sock.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                continue
            if beat.kind == REPLY_HEARTBEAT and beat.rank == rank:
                self.last_sent_s[rank] = max(self.last_sent_s[rank], beat.sent_s)

    def stale(self) -> dict[int, float]:
        """Rank -> seconds since its last beat, for ranks silent longer than
        ``stale_after_s`` (after reading what waits on the sockets)."""
        self.read()
        now_s = time.monotonic()
        return {
            rank: now_s - sent_s
            for rank, sent_s in self.last_sent_s.items()
            if now_s - sent_s > self.stale_after_s
        }

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks = {}
