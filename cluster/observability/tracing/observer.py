"""What happens when a request ends: its phase histograms, one INFO line
(``tandem.request``) with its timings, path and the router's decision, and
its trace when tracing is on. Called once per request from the gateway's generation loop."""

from __future__ import annotations

import logging
from typing import Protocol

from tandem.cluster.observability.tracing.phase_metrics import RequestPhaseMetrics
from tandem.cluster.observability.tracing.record import RequestRecord

request_logger = logging.getLogger("tandem.request")


class Tracer(Protocol):
    def export(self, record: RequestRecord) -> None: ...

    def shutdown(self) -> None: ...


class RequestObserver:
    def __init__(self, metrics: RequestPhaseMetrics, tracer: Tracer | None = None) -> None:
        self.metrics = metrics
        self.tracer = tracer

    def finished(self, record: RequestRecord) -> None:
        phases = record.phases()
        self.metrics.observe(phases, record.path)
        if request_logger.isEnabledFor(logging.INFO):
            fields = {
                "path": record.path,
                "outcome": record.outcome,
                "prompt_tokens": record.num_prompt_tokens,
                "output_tokens": record.num_output_tokens,
                **phases.as_log_fields(),
                **record.router_fields,
            }
            # the record made and handled directly, as ``Logger.info`` would after
            # ``isEnabledFor`` without its caller lookup (one line per request, on the loop)
            line = request_logger.makeRecord(
                request_logger.name,
                logging.INFO,
                __file__,
                _FINISHED_LINE,
                "request finished",
                (),
                None,
                "finished",
                {"request_id": record.request_id, "fields": fields},
            )
            request_logger.handle(line)
        if self.tracer is not None:
            try:
                self.tracer.export(record)
            except Exception:  # noqa: BLE001 - a trace is never worth a request
                request_logger.exception("could not build the trace of %s", record.request_id)


_FINISHED_LINE = RequestObserver.finished.__code__.co_firstlineno  # the line's "lineno"
