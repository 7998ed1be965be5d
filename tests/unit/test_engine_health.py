"""The gateway's liveness model on a simulated clock: slow is not dead."""

from __future__ import annotations

import pytest

from tandem.cluster.engines.health import EngineHealth, Liveness


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(clock: Clock) -> EngineHealth:
    health = EngineHealth(dead_after_s=10.0, slow_after_s=2.0, clock=clock)
    health.reset(epoch=7)
    return health


def test_alive_slow_dead_by_heartbeat_age():
    clock = Clock()
    health = make(clock)
    assert health.liveness() is Liveness.ALIVE
    clock.now_s += 1.9
    assert health.liveness() is Liveness.ALIVE
    clock.now_s += 0.2
    assert health.liveness() is Liveness.SLOW
    clock.now_s += 7.8  # 9.9 s silent
    assert health.liveness() is Liveness.SLOW
    assert health.heartbeat(epoch=7, num_steps=3)
    assert health.liveness() is Liveness.ALIVE and health.num_steps == 3
    clock.now_s += 10.0
    assert health.liveness() is Liveness.DEAD
    # the same incarnation comes back
    assert health.heartbeat(epoch=7, num_steps=4)
    assert health.liveness() is Liveness.ALIVE


def test_other_epoch_heartbeat_is_ignored():
    clock = Clock()
    health = make(clock)
    clock.now_s += 11.0
    assert not health.heartbeat(epoch=8, num_steps=1)
    assert health.liveness() is Liveness.DEAD


def test_actor_dead_until_a_new_incarnation():
    clock = Clock()
    health = make(clock)
    health.orphans.update({"a", "b"})
    health.mark_actor_dead()
    assert health.liveness() is Liveness.DEAD
    assert health.heartbeat(epoch=7, num_steps=1)  # a late one from the socket buffer
    assert health.liveness() is Liveness.DEAD
    health.reset(epoch=9)
    assert health.liveness() is Liveness.ALIVE
    assert health.orphans == set()


def test_thresholds_validated():
    with pytest.raises(ValueError, match="engine_dead_after_s"):
        EngineHealth(dead_after_s=1.0, slow_after_s=2.0)
