"""ProgressPoller: calls progress only while needed, wakes, stops."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.kvtransfer.progress_poller import ProgressPoller


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def test_polls_only_while_needed_and_stops_on_close():
    needed = threading.Event()
    calls: list[float] = []
    poller = ProgressPoller(lambda: calls.append(time.monotonic()), needed.is_set, 0.001)
    try:
        time.sleep(0.1)
        assert calls == []  # nothing held: no NIXL call at all
        needed.set()
        poller.wake()
        wait_for(lambda: len(calls) >= 5)
        needed.clear()
        time.sleep(0.1)  # lets a call in progress finish
        settled = len(calls)
        time.sleep(0.1)
        assert len(calls) == settled
    finally:
        poller.close()
    assert not poller._thread.is_alive()
    assert poller.num_progress_calls == len(calls) and poller.num_errors == 0


def test_a_failing_progress_call_is_counted_and_polling_goes_on():
    def boom() -> None:
        raise RuntimeError("nixl said no")

    poller = ProgressPoller(boom, lambda: True, 0.001)
    try:
        wait_for(lambda: poller.num_errors >= 3)
    finally:
        poller.close()
    assert poller.num_progress_calls == 0


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        ProgressPoller(lambda: None, lambda: False, 0.0)


@pytest.mark.parametrize("value", [-0.001, 2.0, "fast"])
def test_config_names_a_bad_poll_interval(value):
    from tandem.kvtransfer.config import KVTransferConfig

    with pytest.raises(ValueError, match=r"KVTransferConfig\.nixl_progress_poll_interval_s"):
        KVTransferConfig(nixl_progress_poll_interval_s=value)
