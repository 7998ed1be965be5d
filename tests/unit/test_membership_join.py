"""The gateway's health probe when an engine's answer does not list this gateway
(cluster/disagg/membership.py): an engine whose loop runs dropped it (its requests
end with an error, and it is joined again); an engine whose loop has ended (failing
or stopping: it closed every gateway's socket) dropped nothing, so its requests are
left to its death or restart, where they migrate. Fakes for the actor and the data
plane; the probe's own code runs."""

from __future__ import annotations

import asyncio

from tandem.cluster.disagg.engine import Engine, ErrorLog
from tandem.cluster.disagg.membership import Membership
from tandem.cluster.engines.health import EngineHealth
from tandem.cluster.engines.pools import EngineHandle
from tandem.cluster.routing.router import EngineState
from tandem.wire.frames import FrameCounters

SESSION, EPOCH = 7, 11


class _Method:
    def __init__(self, calls: list, name: str, answer):
        self.calls, self.name, self.answer = calls, name, answer

    def remote(self, *args):
        self.calls.append((self.name, args))
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.answer)
        return future


class _Actor:
    def __init__(self, serving: bool):
        self.calls: list = []
        info = {"epoch": EPOCH, "gateways": [], "serving": serving}
        self.ready = _Method(self.calls, "ready", info)
        self.join = _Method(self.calls, "join", {**info, "gateways": [SESSION]})
        self.stats = _Method(self.calls, "stats", b"")


class _Plane:
    output_addr = "tcp://127.0.0.1:1"

    def __init__(self):
        self.failed: list[str] = []

    def fail_requests(self, e, message, reason=None):
        self.failed.append(message)


def _probe(serving: bool) -> tuple[_Actor, _Plane, Engine]:
    actor, plane = _Actor(serving), _Plane()
    e = Engine(
        EngineHandle("decode-0", "decode", actor),
        EngineState("decode-0", "decode", epoch=EPOCH, ready=True),
        EngineHealth(dead_after_s=30.0),
    )
    e.health.reset(EPOCH)
    e.requests.add("cmpl-1")
    m = Membership(
        {"decode-0": e}, plane, None, ErrorLog(), FrameCounters(),
        health_interval_s=0.5, call_timeout_s=5.0, gateway_session=SESSION,
    )  # fmt: skip
    asyncio.run(m.check(e))
    return actor, plane, e


def test_an_engine_whose_loop_runs_dropped_this_gateway_and_is_joined_again():
    actor, plane, _ = _probe(serving=True)
    assert plane.failed == ["engine decode-0 dropped this gateway's requests"]
    assert [name for name, _ in actor.calls][:2] == ["ready", "join"]


def test_an_engine_whose_loop_ended_is_not_a_drop_its_requests_wait_for_its_verdict():
    actor, plane, e = _probe(serving=False)
    assert plane.failed == []  # not ended with an error: death or restart decides
    assert "join" not in [name for name, _ in actor.calls]  # nothing to join
    assert e.requests == {"cmpl-1"} and not e.answered


class _Silent(_Method):
    """An actor method that never answers (a join stuck in the engine)."""

    def remote(self, *args):
        self.calls.append((self.name, args))
        return asyncio.get_running_loop().create_future()


def test_a_join_that_never_answers_is_said_each_probe_and_asked_again(caplog):
    actor = _Actor(serving=True)
    actor.join = _Silent(actor.calls, "join", None)
    e = Engine(
        EngineHandle("decode-0", "decode", actor),
        EngineState("decode-0", "decode", epoch=EPOCH, ready=True),
        EngineHealth(dead_after_s=30.0),
    )
    e.health.reset(EPOCH)
    m = Membership(
        {"decode-0": e}, _Plane(), None, ErrorLog(), FrameCounters(),
        health_interval_s=0.5, call_timeout_s=0.05, gateway_session=SESSION,
    )  # fmt: skip

    async def two_probes():
        await m.check(e)
        await m.check(e)

    with caplog.at_level("WARNING", logger="tandem.cluster.disagg.membership"):
        asyncio.run(two_probes())
    assert [name for name, _ in actor.calls if name != "stats"] == ["ready", "join"] * 2
    assert m.num_join_timeouts == 2 and m.num_joins == 0
    said = [r.getMessage() for r in caplog.records if "joining it took over" in r.getMessage()]
    assert said == [
        "engine decode-0: joining it took over 0.05 s (1 times); the next probe tries again",
        "engine decode-0: joining it took over 0.05 s (2 times); the next probe tries again",
    ]
    assert not e.health.actor_dead  # no verdict


def test_a_new_engine_whose_join_times_out_is_not_connected_to_this_gateway():
    """``ready`` answered but the join did not: the engine does not serve this gateway,
    so the probe connects nothing and it is not counted as answered (nor registered)."""
    actor = _Actor(serving=True)
    actor.ready.answer = {**actor.ready.answer, "input_addr": "tcp://127.0.0.1:2"}
    actor.join = _Silent(actor.calls, "join", None)
    e = Engine(
        EngineHandle("decode-0", "decode", actor),
        EngineState("decode-0", "decode"),  # not up yet for this gateway: epoch 0
        EngineHealth(dead_after_s=30.0),
    )
    connected = []
    plane = _Plane()
    plane.connect = lambda engine, addr, epoch: connected.append((addr, epoch))
    m = Membership(
        {"decode-0": e}, plane, None, ErrorLog(), FrameCounters(),
        health_interval_s=0.5, call_timeout_s=0.05, gateway_session=SESSION,
    )  # fmt: skip
    asyncio.run(m.check(e))
    assert m.num_join_timeouts == 1
    assert connected == [] and e.state.epoch == 0
    assert not e.answered and not e.state.ready
