"""A stream moved mid-way, as the gateway's migration moves it, for the speculative tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.cluster.disagg.migration import StreamLedger


@dataclass
class Moved:
    ledger: StreamLedger  # every token the client got, before and after the move
    first: Any  # the engine that was lost
    second: Any  # the engine that finished the stream
    resubmitted: Any  # the EngineRequest the second engine got
    sent_before: int  # tokens sent before the move


def migrate_mid_stream(make_engine: Callable[[], Any], request: Any, after: int) -> Moved:
    """Run ``request`` on one engine until ``after`` tokens are sent, lose that engine (its
    requests aborted, its KV freed), and finish the stream on a second from
    ``StreamLedger.resubmission()`` (prompt + sent tokens); both pass check_integrity()."""
    first = make_engine()
    ledger = StreamLedger(request)
    assert first.add_request(request) is None
    while len(ledger.sent_token_ids) < after:
        for o in first.step().outputs:
            assert o.error is None, o.error
            ledger.record(o)
    first.abort([request.request_id])  # the engine is lost
    while first.has_work():
        first.step()
    first.check_integrity()
    sent_before = len(ledger.sent_token_ids)
    second = make_engine()
    resubmitted = ledger.resubmission()
    assert second.add_request(resubmitted) is None
    while second.has_work():
        for o in second.step().outputs:
            assert o.error is None, o.error
            ledger.record(o)
    second.check_integrity()
    return Moved(ledger, first, second, resubmitted, sent_before)
