"""OpenTelemetry spans of finished requests (``--otlp-traces-endpoint``).

Imported only when tracing is on. The gateway builds every span itself,
engine-side ones included, from the request's record (``record.py``) with
explicit start and end times, after the request ended, so one exporter
serves the whole cluster and engines need no tracing config:

    gateway                      arrival -> last output       (root, SERVER)
    ├── tokenize                 arrival -> dispatch
    ├── prefill                  engine receipt -> first token   (P or local)
    │   ├── prefill.queue        receipt -> first compute
    │   └── prefill.compute      first compute -> first token
    ├── kv_transfer              D: blocks allocated -> READ landed (remote only)
    └── decode                   first token / D's first compute -> last token

An incoming W3C ``traceparent`` makes ``gateway`` a child of the caller's
span (same trace id). Spans go through a ``BatchSpanProcessor`` (a
background thread exports them over OTLP/HTTP protobuf); tests pass an
exporter, which is then called synchronously.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tandem.cluster.observability.tracing.record import EngineLeg, RequestRecord

SERVICE_NAME = "tandem"


class OtelTracer:
    """Builds and exports one trace per finished request."""

    def __init__(self, endpoint: str | None = None, exporter: SpanExporter | None = None) -> None:
        """``endpoint``: the full OTLP/HTTP traces URL (``settings.traces_url``).
        ``exporter`` (tests): used instead, synchronously."""
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            if endpoint is None:
                raise ValueError("otlp_traces_endpoint is required without an exporter")
            processor: Any = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        else:
            processor = SimpleSpanProcessor(exporter)
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("tandem.gateway")
        self.propagator = TraceContextTextMapPropagator()

    def export(self, record: RequestRecord) -> None:
        parent = None
        if record.traceparent:
            parent = self.propagator.extract({"traceparent": record.traceparent})
        end_s = max(record.end_s, record.arrival_s)
        root = self.tracer.start_span(
            "gateway",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=record.wall_ns(record.arrival_s),
            attributes={
                "tandem.request_id": record.request_id,
                "http.route": f"/v1/{record.route.replace('.', '/')}",
                "tandem.path": record.path,
                "tandem.outcome": record.outcome,
                "gen_ai.usage.input_tokens": record.num_prompt_tokens,
                "gen_ai.usage.output_tokens": record.num_output_tokens,
            },
        )
        ctx = trace.set_span_in_context(root)
        if record.dispatch_s >= 0:
            self._span("tokenize", ctx, record, record.arrival_s, record.dispatch_s, {})
        prefill, decode = record.prefill_leg, record.decode_leg
        if prefill is not None:
            self._prefill(ctx, record, prefill)
        if decode is not None:
            self._remote_decode(ctx, record, decode, prefill)
        elif prefill is not None and prefill.timings.first_token_s >= 0:
            t = prefill.timings
            self._span(
                "decode",
                ctx,
                record,
                prefill.at(t.first_token_s),
                prefill.received_s,
                _engine_attributes(prefill),
            )
        root.end(end_time=record.wall_ns(end_s))

    def _prefill(self, ctx: Any, record: RequestRecord, leg: EngineLeg) -> None:
        t = leg.timings
        end_s = leg.at(t.first_token_s) if t.first_token_s >= 0 else leg.received_s
        attributes = _engine_attributes(leg)
        attributes["tandem.num_preemptions"] = t.num_preemptions
        span = self._span("prefill", ctx, record, leg.receipt_s, end_s, attributes, end=False)
        inner = trace.set_span_in_context(span)
        if t.scheduled_s >= 0:
            self._span("prefill.queue", inner, record, leg.receipt_s, leg.at(t.scheduled_s), {})
            self._span("prefill.compute", inner, record, leg.at(t.scheduled_s), end_s, {})
        span.end(end_time=record.wall_ns(max(end_s, leg.receipt_s)))

    def _remote_decode(
        self, ctx: Any, record: RequestRecord, leg: EngineLeg, prefill: EngineLeg | None
    ) -> None:
        t = leg.timings
        if t.kv_load_start_s >= 0:
            attributes = _engine_attributes(leg)
            attributes.update(
                {
                    "tandem.kv.num_blocks": t.num_kv_blocks,
                    "tandem.kv.num_bytes": t.num_kv_bytes,
                    "tandem.kv.num_descriptors": t.num_kv_descriptors,
                }
            )
            if prefill is not None:
                attributes["tandem.kv.source_engine_id"] = prefill.timings.engine_id
                attributes["tandem.kv.source_engine_epoch"] = prefill.timings.epoch
            end_s = leg.at(t.kv_load_end_s) if t.kv_load_end_s >= 0 else leg.received_s
            self._span("kv_transfer", ctx, record, leg.at(t.kv_load_start_s), end_s, attributes)
        start_s = leg.at(t.scheduled_s) if t.scheduled_s >= 0 else leg.receipt_s
        self._span("decode", ctx, record, start_s, leg.received_s, _engine_attributes(leg))

    def _span(
        self,
        name: str,
        ctx: Any,
        record: RequestRecord,
        start_s: float,
        end_s: float,
        attributes: dict[str, Any],
        end: bool = True,
    ) -> Any:
        span = self.tracer.start_span(
            name, context=ctx, start_time=record.wall_ns(start_s), attributes=attributes
        )
        if end:
            span.end(end_time=record.wall_ns(max(start_s, end_s)))
        return span

    def shutdown(self) -> None:
        """Flush what is queued and stop the export thread."""
        self.provider.shutdown()


def _engine_attributes(leg: EngineLeg) -> dict[str, Any]:
    t = leg.timings
    return {
        "tandem.engine.id": t.engine_id,
        "tandem.engine.epoch": t.epoch,
        "tandem.engine.role": t.role,
    }
