"""The text log format's lines: the same bytes as ``logging.Formatter``'s; the
finished-request line's phase fields."""

from __future__ import annotations

import dataclasses
import logging

from tandem.cluster.observability.logging_setup import _TEXT_FORMAT, RequestIdFilter, TextFormatter
from tandem.cluster.observability.tracing.record import Phases


def _record(created: float, fields: dict | None) -> logging.LogRecord:
    extra = {"request_id": "cmpl-1", "fields": fields} if fields is not None else {}
    record = logging.getLogger("tandem.request").makeRecord(
        "tandem.request", logging.INFO, __file__, 1, "request finished", (), None, "f", extra
    )
    record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
    RequestIdFilter().filter(record)
    return record


def test_text_formatter_writes_what_logging_formatter_writes():
    ours, stock = TextFormatter(_TEXT_FORMAT), logging.Formatter(_TEXT_FORMAT)
    fields = {"path": "local", "output_tokens": 128, "queue_s": 0.000123, "transfer_s": None}
    # within one second (the cached text), across seconds, and back to an earlier one
    for created in (1764250000.001, 1764250000.999, 1764250001.5, 1764250000.25, 1.0):
        for f in (fields, None):
            record = _record(created, f)
            assert ours.format(record) == stock.format(record)
    assert "output_tokens=128 queue_s=0.000123 transfer_s=-" in ours.format(_record(1.0, fields))
    datefmt = TextFormatter(_TEXT_FORMAT)
    record = _record(1764250000.5, None)
    assert datefmt.formatTime(record, "%H") == stock.formatTime(record, "%H")


def test_phase_log_fields_name_every_phase():
    phases = Phases(0.1234567, None, None, 0.5, 1.0, 2.0000004)
    fields = phases.as_log_fields()
    assert list(fields) == [f.name for f in dataclasses.fields(Phases)]
    assert fields["queue_s"] == 0.123457 and fields["prefill_s"] is None
    assert fields["total_s"] == 2.0
