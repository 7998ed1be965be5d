"""Validation of inbound ZMQ messages: a bad one is dropped, never raised.

Every receiving loop of the internal planes reads raw frames and hands them
to ``FrameSpec.decode`` (``[kind, payload]`` messages) or to the helpers
below; a message with the wrong frame count, an unknown kind, a frame over
the size cap, bytes that are not msgpack or msgpack of the wrong type raises
``MalformedFrame``, which the loop records in a ``FrameCounters`` (counted
per socket, logged with the sender's address, at most once per second per
socket) before reading on. Nothing here blocks or allocates beyond what
ZMQ already received; the hard ceiling for one frame is set on the socket
(``ZMQ_MAXMSGSIZE``, ``hard_limit``) so a huge frame cuts the sender's
connection instead of filling memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

MiB = 1 << 20
# libzmq's own ceiling is this many times a socket's application cap: frames
# between the two are received, counted and dropped; beyond it the sender's
# connection is cut before the frame is allocated.
HARD_LIMIT_FACTOR = 4


class MalformedFrame(Exception):
    """A message that does not match its socket's spec; ``str`` says why."""


def frame_bytes(frame: Any) -> bytes:
    """The bytes of a ``zmq.Frame`` (``copy=False``) or of plain bytes.
    ``Frame.bytes`` is the cheapest way out for the small frames of the
    per-token path; check ``len(frame)`` against the cap first."""
    return frame if isinstance(frame, bytes) else frame.bytes


def peer_address(frames: Sequence[Any]) -> str:
    """The sender's address as ZMQ saw it (TCP frames received with
    ``copy=False``), else ``"unknown"``."""
    for frame in frames:
        get = getattr(frame, "get", None)
        if get is None:
            continue
        try:
            return str(get("Peer-Address"))
        except Exception:  # noqa: BLE001 - not TCP, or property unsupported
            return "unknown"
    return "unknown"


def check_size(frame: Any, max_bytes: int) -> None:
    """``frame`` is bytes or a ``zmq.Frame`` (its length is known without a copy)."""
    if len(frame) > max_bytes:
        raise MalformedFrame(f"frame of {len(frame)} bytes exceeds the cap of {max_bytes}")


def decode(decoder: msgspec.msgpack.Decoder, payload: bytes) -> Any:
    """``decoder.decode`` with every decoding failure as ``MalformedFrame``."""
    try:
        return decoder.decode(payload)
    except msgspec.ValidationError as e:
        raise MalformedFrame(f"msgpack of the wrong type: {e}") from None
    except msgspec.DecodeError as e:
        raise MalformedFrame(f"not msgpack: {e}") from None


class FrameSpec:
    """``[kind, payload]`` messages of one socket: ``kinds`` maps each kind
    byte string to the msgspec type its payload must decode to."""

    def __init__(self, socket: str, kinds: Mapping[bytes, Any], max_frame_bytes: int) -> None:
        self.socket = socket
        self.max_frame_bytes = max_frame_bytes
        self._decoders = {k: msgspec.msgpack.Decoder(t) for k, t in kinds.items()}

    @property
    def hard_limit(self) -> int:
        """Value for the receiving socket's ``zmq.MAXMSGSIZE``."""
        return self.max_frame_bytes * HARD_LIMIT_FACTOR

    def decode(self, frames: Sequence[Any]) -> tuple[bytes, Any]:
        """``(kind, message)``; raises ``MalformedFrame``."""
        if len(frames) != 2:
            raise MalformedFrame(f"expected 2 frames [kind, payload], got {len(frames)}")
        kind = frame_bytes(frames[0])
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise MalformedFrame(f"unknown message kind {kind[:16]!r}")
        check_size(frames[1], self.max_frame_bytes)
        return kind, decode(decoder, frame_bytes(frames[1]))


class FrameCounters:
    """Malformed-message counts per socket name; safe to update from any
    thread. ``snapshot()`` is what engines report through their stats."""

    def __init__(self, log_interval_s: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._log_interval_s = log_interval_s

    def record(self, socket: str, source: str, error: MalformedFrame | str) -> None:
        """Count one dropped message of ``socket`` from ``source``; logs a
        warning, rate-limited so a flood cannot fill the log."""
        now = time.monotonic()
        with self._lock:
            self._counts[socket] = self._counts.get(socket, 0) + 1
            if now - self._last_log.get(socket, -1e9) < self._log_interval_s:
                self._unlogged[socket] = self._unlogged.get(socket, 0) + 1
                return
            self._last_log[socket] = now
            suppressed = self._unlogged.pop(socket, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        logger.warning(
            "dropped a malformed message on %s from %s: %s%s", socket, source, error, more
        )

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
