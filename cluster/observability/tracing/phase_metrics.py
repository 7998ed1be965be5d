"""Per-request phase histograms, from the engines' timings (vLLM's names
under ``tandem:``; ``path`` as on TTFT/ITL/E2E):

    tandem:request_queue_time_seconds{path}    engine receipt -> first compute
                                               (the engine that prefilled)
    tandem:request_prefill_time_seconds{path}  first compute -> first token there
    tandem:request_decode_time_seconds{path}   first token (local) or D's first
                                               compute (remote) -> last token
    tandem:kv_transfer_time_seconds            D: blocks allocated -> READ landed
                                               (handshake included), per request
    tandem:request_gateway_time_seconds        HTTP arrival -> dispatch (parse,
                                               validate, tokenize, admit)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from tandem.cluster.observability.metrics import PREFIX, LoopHistogram, PathHistogram
from tandem.cluster.observability.tracing.record import Phases

PHASE_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip


class RequestPhaseMetrics(Collector):
    """Written on the gateway's event loop at each request's end; read by
    ``/metrics`` on the same loop."""

    def __init__(self) -> None:
        self.queue = PathHistogram(
            f"{PREFIX}request_queue_time_seconds",
            "Engine receipt to the request's first compute (or KV load), on the "
            "engine that prefilled it.",
            PHASE_BUCKETS_S,
        )
        self.prefill = PathHistogram(
            f"{PREFIX}request_prefill_time_seconds",
            "First compute to first token on the engine that prefilled the request.",
            PHASE_BUCKETS_S,
        )
        self.decode = PathHistogram(
            f"{PREFIX}request_decode_time_seconds",
            "First token (local) or the decode engine's first compute (remote) to the last token.",
            PHASE_BUCKETS_S,
        )
        self.transfer = LoopHistogram(
            f"{PREFIX}kv_transfer_time_seconds",
            "Per remote request: decode engine allocated blocks for the KV read "
            "to the read landing (handshake included).",
            PHASE_BUCKETS_S,
        )
        self.gateway = LoopHistogram(
            f"{PREFIX}request_gateway_time_seconds",
            "HTTP arrival to dispatch to the backend (parse, validate, tokenize, admit).",
            PHASE_BUCKETS_S,
        )

    def observe(self, phases: Phases, path: str) -> None:
        if phases.queue_s is not None:
            self.queue.observe(phases.queue_s, path)
        if phases.prefill_s is not None:
            self.prefill.observe(phases.prefill_s, path)
        if phases.decode_s is not None:
            self.decode.observe(phases.decode_s, path)
        if phases.transfer_s is not None:
            self.transfer.observe(phases.transfer_s)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for histogram in (self.queue, self.prefill, self.decode, self.transfer, self.gateway):
            yield histogram.family()
