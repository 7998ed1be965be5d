"""Dead in milliseconds, on positive evidence only.

Missing heartbeats make an engine SLOW, and DEAD only after
``engine_dead_after_s`` (``health.py``): a paused or starved engine must keep
its streams. A crashed engine should lose them at once, so that they migrate
(``cluster/disagg/migration.py``) before the client notices. The fast path:

    engine process exits
      -> its kernel closes the engine's bound input socket
      -> the gateway's PUSH socket to that engine (one per incarnation) sees
         the TCP connection drop: ZMQ monitor EVENT_DISCONNECTED     (signal)
      -> confirm, within ``confirm_window_s``:
           the engine's pid is on this node: /proc says the process is gone
                                             or a zombie              (dead)
           otherwise: the usual Ray probe (``ready``): Ray says the
                      actor died, or a new incarnation answers       (dead)
      -> not confirmed: no verdict; heartbeats decide as before

A SIGSTOPped or starved engine keeps its TCP connections (the kernel answers
for it), so it never raises the signal; a disconnect alone (e.g. a network
fault between nodes) is not a verdict either, only the confirmation is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)
_monitor_ids = itertools.count()


def process_gone(pid: int) -> bool:
    """True only if process ``pid`` of this node has exited: no such process,
    or a zombie (exited, not yet reaped by its parent). False when it exists
    or cannot be told (permissions)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    # "pid (comm) S ...": comm may hold spaces and parentheses, the state
    # follows the last ")"
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


class DisconnectWatch:
    """Calls ``on_disconnect(engine_id, epoch)`` when the gateway's input
    socket to that engine incarnation loses its connection. ``watch`` must be
    called on the event loop that owns the sockets; a new ``watch`` of the same
    engine (a new incarnation) replaces the old one. The callback runs on the
    event loop and must not block."""

    def __init__(self, on_disconnect: Callable[[str, int], None]) -> None:
        self._on_disconnect = on_disconnect
        self._watches: dict[str, tuple[asyncio.Task, zmq.asyncio.Socket]] = {}

    def watch(self, engine_id: str, epoch: int, socket: zmq.asyncio.Socket) -> None:
        self.unwatch(engine_id)
        # a name of our own: pyzmq's default is per file descriptor, and the
        # closed socket of the previous incarnation (its fd now reused) may
        # still hold it while ZMQ tears it down ("Address already in use")
        monitor = socket.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED,
            addr=f"inproc://tandem-disconnect-{id(self)}-{next(_monitor_ids)}",
        )
        task = asyncio.create_task(self._run(engine_id, epoch, monitor))
        self._watches[engine_id] = (task, monitor)

    def unwatch(self, engine_id: str) -> None:
        """Stop watching now (the monitor socket is closed before this returns,
        so the context can be terminated right after)."""
        watch = self._watches.pop(engine_id, None)
        if watch is not None:
            task, monitor = watch
            task.cancel()
            monitor.close(linger=0)

    def close(self) -> None:
        for engine_id in list(self._watches):
            self.unwatch(engine_id)

    async def _run(self, engine_id: str, epoch: int, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return  # the watched socket was closed (a new incarnation)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._on_disconnect(engine_id, epoch)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        except Exception:  # noqa: BLE001 - a broken watch only loses the fast path
            logger.exception("disconnect watch of %s ended", engine_id)


async def confirm_exit(pid: int, window_s: float, poll_s: float = 0.01) -> bool:
    """Poll ``process_gone(pid)`` for up to ``window_s``: a disconnect is seen
    while the process is still tearing down, a moment before /proc shows it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window_s
    while True:
        if process_gone(pid):
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(poll_s)
