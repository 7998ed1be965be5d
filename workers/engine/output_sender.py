"""The engine's output socket with a bounded send queue (backpressure).

::

    engine loop --send--> [local backlog, <= backlog_messages] --NOBLOCK--> ZMQ PUSH
                                                                (SNDHWM = hwm_messages)
                                                                  --> gateway PULL

``send`` never blocks. ZMQ queues up to ``hwm_messages`` (plus the kernel's
socket buffers); past that, messages wait in the local backlog. The engine
loop reads the state:

- ``blocked`` (backlog not empty): the engine stops stepping, so a gateway
  that cannot keep up slows the engine down instead of growing a queue;
  it still serves input and control calls.
- ``full`` (backlog at its bound): it also stops reading input, so the
  gateway's own sends back up (its PUSH is non-blocking: it sees the
  engine as overloaded). Memory stays bounded by the two limits.
- ``stalled_s``: how long nothing could be sent. Past the engine's
  ``output_stall_timeout_s`` the loop cuts every stream with an error and
  frees its KV (a gateway that reads nothing for that long is gone).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import zmq


class OutputSender:
    def __init__(
        self,
        sock: zmq.Socket,
        backlog_messages: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if backlog_messages < 1:
            raise ValueError(f"backlog_messages must be >= 1, got {backlog_messages}")
        self._sock = sock
        self._max = backlog_messages
        self._clock = clock
        self._backlog: collections.deque[list[bytes]] = collections.deque()
        self._blocked_since: float | None = None
        self.num_deferred = 0  # messages that had to wait in the backlog (cumulative)

    @property
    def socket(self) -> zmq.Socket:
        return self._sock

    @property
    def blocked(self) -> bool:
        return bool(self._backlog)

    @property
    def full(self) -> bool:
        return len(self._backlog) >= self._max

    @property
    def backlog_len(self) -> int:
        return len(self._backlog)

    @property
    def stalled_s(self) -> float:
        """Seconds since a message last had to wait without any being sent."""
        return 0.0 if self._blocked_since is None else self._clock() - self._blocked_since

    def reset_stall(self) -> None:
        """Start counting the stall again (after the loop acted on it)."""
        if self._backlog:
            self._blocked_since = self._clock()

    def discard(self) -> int:
        """Drop what the backlog holds (outputs for a gateway that is gone);
        returns how many messages were dropped."""
        dropped = len(self._backlog)
        self._backlog.clear()
        self._blocked_since = None
        return dropped

    def send(self, frames: list[bytes]) -> None:
        """Queue ``frames`` for the gateway; never blocks. May exceed the
        backlog bound by the caller's own messages (the loop stops producing
        once ``full``), never by more."""
        if not self.flush() or not self._try_send(frames):
            if not self._backlog:
                self._blocked_since = self._clock()
            self._backlog.append(frames)
            self.num_deferred += 1

    def flush(self) -> bool:
        """Send what the backlog holds, oldest first, until ZMQ refuses.
        True when the backlog is empty."""
        while self._backlog:
            if not self._try_send(self._backlog[0]):
                return False
            self._backlog.popleft()
            self._blocked_since = self._clock() if self._backlog else None
        return True

    def _try_send(self, frames: list[bytes]) -> bool:
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
