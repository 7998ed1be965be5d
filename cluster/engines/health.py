"""Slow is not dead: the gateway's liveness model of one engine.

Evidence, all measured on the gateway's monotonic clock (no clocks compared
between machines):

    heartbeat   an EngineHeartbeat from the engine's loop thread (about every
                0.5 s, between steps), with its epoch and step count
    ray         the actor's control calls: an answer, a timeout (slow or
                paused: no verdict), or Ray saying the actor died

    ALIVE  a heartbeat within ``slow_after_s``
    SLOW   no heartbeat for ``slow_after_s`` .. ``dead_after_s`` (a long step, a
           paused or starved process): its requests are kept and complete
           when it catches up
    DEAD   Ray reports the actor dead, or no heartbeat for ``dead_after_s``

Only DEAD fails an engine's requests. Those ids are kept as the engine's
orphans; if the same incarnation (epoch) comes back, the backend tells it
to abort them, so it never computes for nobody. A new epoch (Ray restarted
the actor) holds nothing, and its orphans are dropped.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.wire.config_fields import option


@dataclass(frozen=True)
class HealthConfig:
    """How the gateway judges its engines: a section of the serve configuration."""

    engine_dead_after_s: float = option(
        30.0,
        help="an engine without a heartbeat this long is dead: its requests fail "
        "(a slower one keeps them)",
    )
    engine_call_timeout_s: float = option(
        5.0, help="a Ray control call slower than this gives no verdict (the engine may be slow)"
    )

    def __post_init__(self) -> None:
        for name in ("engine_dead_after_s", "engine_call_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Liveness(enum.Enum):
    ALIVE = "alive"
    SLOW = "slow"
    DEAD = "dead"


class EngineHealth:
    """One engine's liveness. Event-loop thread only; ``clock`` is injectable
    for tests (seconds, monotonic)."""

    def __init__(
        self,
        *,
        dead_after_s: float,
        slow_after_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < slow_after_s < dead_after_s:
            raise ValueError(
                f"engine_dead_after_s ({dead_after_s}) must be > the slow threshold "
                f"({slow_after_s}) > 0"
            )
        self.dead_after_s = dead_after_s
        self.slow_after_s = slow_after_s
        self._clock = clock
        self.epoch = 0
        self.num_steps = 0
        self.last_heartbeat_s = clock()
        self.actor_dead = False
        self.orphans: set[str] = set()  # failed here while dead; abort if it returns

    def reset(self, epoch: int) -> None:
        """A (new) incarnation answered ``ready()``: alive from now, no orphans."""
        self.epoch = epoch
        self.num_steps = 0
        self.last_heartbeat_s = self._clock()
        self.actor_dead = False
        self.orphans.clear()

    def heartbeat(self, epoch: int, num_steps: int) -> bool:
        """Record a heartbeat; False (ignored) if it is from another epoch."""
        if epoch != self.epoch:
            return False
        self.num_steps = num_steps
        self.last_heartbeat_s = self._clock()
        return True

    def mark_actor_dead(self) -> None:
        """Ray says the actor process is gone (or being restarted): dead until
        ``reset`` (a late heartbeat from the socket's buffer does not revive it)."""
        self.actor_dead = True

    def seconds_since_heartbeat(self) -> float:
        return self._clock() - self.last_heartbeat_s

    def liveness(self) -> Liveness:
        if self.actor_dead:
            return Liveness.DEAD
        silent_s = self.seconds_since_heartbeat()
        if silent_s >= self.dead_after_s:
            return Liveness.DEAD
        if silent_s >= self.slow_after_s:
            return Liveness.SLOW
        return Liveness.ALIVE
