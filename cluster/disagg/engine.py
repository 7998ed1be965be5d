"""The backend's record of one engine, and its log of recent failures.

``Engine`` is shared by the backend's parts: the data plane owns its input
socket and the request ids in flight there, membership everything learnt
from probing it (epoch, health, stats, registry state), the router its load
counters (``state``).
"""

from __future__ import annotations

import collections
import time

import zmq.asyncio

from tandem.cluster.engines.health import EngineHealth
from tandem.cluster.engines.pools import EngineHandle
from tandem.cluster.gateway.backend import ErrorEvent
from tandem.cluster.routing.router import EngineState
from tandem.scheduler.engine_stats import EngineStats


class Engine:
    def __init__(self, handle: EngineHandle, state: EngineState, health: EngineHealth) -> None:
        self.handle = handle
        self.state = state
        self.health = health
        self.socket: zmq.asyncio.Socket | None = None
        self.requests: set[str] = set()  # request ids in flight here
        self.stats: EngineStats | None = None  # the latest it reported
        self.num_restarts = 0
        self.last_error = ""
        # decode: (own epoch, prefill endpoints) it last acknowledged
        self.pushed_endpoints: tuple[int, list] | None = None
        # new incarnation not yet in the registry exchange: a prefill engine
        # not yet known to the decode engines, a decode engine without the list
        self.unregistered = False
        self.answered = False  # the last health check got an answer
        self.draining = False  # an operator drained it: no new work (migration)
        self.local_pid: int | None = None  # its pid, when visible from this process
        self.removed = False  # taken out of its pool (scaling.py): probes ignore it


class Traffic:
    """The backend's own load figures, cumulative (the planner's input):
    requests that arrived, their prompt tokens and ``max_tokens``; requests
    that ended having delivered tokens, and how many. Counted once per
    request, never per token."""

    def __init__(self) -> None:
        self.arrivals = 0
        self.prompt_tokens = 0
        self.finished = 0
        self.output_tokens = 0
        self.requested_output_tokens = 0  # max_tokens of the arrivals

    def arrived(self, num_prompt_tokens: int, max_tokens: int = 0) -> None:
        self.arrivals += 1
        self.prompt_tokens += num_prompt_tokens
        self.requested_output_tokens += max_tokens

    def ended(self, num_output_tokens: int) -> None:
        self.finished += 1
        self.output_tokens += num_output_tokens


class ErrorLog:
    """Failures worth an operator's eye (``/cluster/state``), newest last, bounded."""

    def __init__(self, maxlen: int = 50) -> None:
        self.events: collections.deque[ErrorEvent] = collections.deque(maxlen=maxlen)

    def add(self, source: str, message: str, engine: Engine | None = None) -> None:
        self.events.append(ErrorEvent(time.time(), source, message))
        if engine is not None:
            engine.last_error = message


def engine_index(e: Engine) -> int:
    """N of an engine named ``<role>-N`` (0 when not so named): the newest has the highest."""
    try:
        return int(e.state.engine_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def cause_text(exc: BaseException) -> str:
    """One line naming why a Ray call failed (its cause's type and last line)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"[:500]
