"""What the backend registers with decode engines (cluster/engines/prefill_endpoints.py):
the list, when it is pushed again, and what a failed push leaves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tandem.cluster.engines.prefill_endpoints import prefill_endpoints, push_prefill_endpoints
from tandem.cluster.routing.router import EngineState


def engine(engine_id: str, role: str, epoch: int, kv_address=None):
    state = EngineState(engine_id, role, epoch=epoch, info={"kv_address": kv_address})
    return SimpleNamespace(state=state, pushed_endpoints=None)


def test_list_names_prefill_engines_with_an_address_at_their_epoch():
    engines = [
        engine("prefill-1", "prefill", 7, ["10.0.0.2", 6001]),
        engine("prefill-0", "prefill", 5, ["10.0.0.1", 6000]),
        engine("prefill-2", "prefill", 0, ["10.0.0.3", 6002]),  # never came up
        engine("prefill-3", "prefill", 9, None),  # no side channel
        engine("decode-0", "decode", 3, None),
    ]
    assert prefill_endpoints(engines) == [
        ["prefill-0", 5, "10.0.0.1", 6000],
        ["prefill-1", 7, "10.0.0.2", 6001],
    ]


def test_decode_engines_with_a_host_tier_lend_and_colocated_lists_stand_apart():
    # a decode engine keeping a host KV tier serves its KV (kv role "both"): listed
    engines = [
        engine("prefill-0", "prefill", 5, ["10.0.0.1", 6000]),
        engine("decode-0", "decode", 3, ["10.0.0.4", 6004]),
        engine("decode-1", "decode", 2, None),  # no tier: reads only
        engine("colocated-0", "colocated", 1, ["10.0.0.5", 6005]),
    ]
    assert prefill_endpoints(engines) == [
        ["decode-0", 3, "10.0.0.4", 6004],
        ["prefill-0", 5, "10.0.0.1", 6000],
    ]
    assert prefill_endpoints(engines, ("colocated",)) == [["colocated-0", 1, "10.0.0.5", 6005]]


def test_pushed_once_per_change_and_retried_after_a_failure():
    p = engine("prefill-0", "prefill", 5, ["10.0.0.1", 6000])
    d0, d1 = engine("decode-0", "decode", 3), engine("decode-1", "decode", 4)
    calls: list[tuple[str, list]] = []
    failing: set[str] = set()

    async def call(e, endpoints):
        calls.append((e.state.engine_id, endpoints))
        if e.state.engine_id in failing:
            raise ConnectionError("actor gone")

    def push() -> bool:
        return asyncio.run(push_prefill_endpoints([d0, d1], [p, d0, d1], call, 1.0))

    assert push() and [c[0] for c in calls] == ["decode-0", "decode-1"]
    calls.clear()
    assert push() and calls == []  # nothing changed: nothing sent
    p.state.epoch = 6  # P restarted
    failing.add("decode-1")
    assert not push()
    assert d0.pushed_endpoints == (3, [["prefill-0", 6, "10.0.0.1", 6000]])
    assert d1.pushed_endpoints == (4, [["prefill-0", 5, "10.0.0.1", 6000]])  # still the old one
    calls.clear()
    failing.clear()
    assert push() and [c[0] for c in calls] == ["decode-1"]  # retried
    d0.state.epoch = 8  # D restarted: it gets the list again
    calls.clear()
    assert push() and [c[0] for c in calls] == ["decode-0"]
