"""Chaos, second service (load-failure policy ``fail``, ``max_restarts=3``):
injected NIXL READ failures end the requests they hit with an explicit error.
Same verdicts as tests/chaos/test_chaos_recompute.py."""

from __future__ import annotations

import os

import pytest

from tests.chaos.service import (
    chaos_service,
    kv_read_failures,
    settle,
)
from tests.chaos.test_chaos_recompute import run

pytestmark = pytest.mark.slow

NUM_KILLS = 5


@pytest.fixture(scope="module")
def chaos():
    with chaos_service("fail", max_restarts=3) as svc_switch_refs:
        yield svc_switch_refs


def test_injected_nixl_read_failure_fail_policy_errors_explicitly(chaos):
    svc, switch, refs = chaos
    before = kv_read_failures(svc)
    open(switch, "w").close()
    try:
        tally, _, _ = run(svc, refs, "NIXL READ fails (policy fail)", lambda _: None, min_tokens=0)
    finally:
        os.remove(switch)
    assert kv_read_failures(svc) > before
    # every read failed: each request got P's token, then an explicit error
    assert tally.errored > 0 and tally.identical + tally.errored == tally.requests
    assert settle(svc) == 0
