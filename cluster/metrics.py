"""Prometheus metrics of the gateway and, read at scrape time, of the engines.

Names follow vLLM's under the ``tandem:`` prefix (ARCHITECTURE §6). Two kinds:

* request-level, measured in the gateway (``GatewayMetrics``): TTFT, ITL,
  end-to-end and queue time histograms, token and request counters;
* engine-level, labelled ``engine`` and ``role``, copied from
  ``Backend.metrics_snapshot()`` by ``EngineMetricsCollector`` at each scrape.

Both are ``Collector``s read at scrape time. Each app owns a
``CollectorRegistry``, so several gateways can live in one process (tests)
without clashing in the global registry.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cluster.backend import Backend, BackendMetrics, EngineMetrics
from cluster.kv_routing.metrics import router_families

PREFIX = "tandem:"

_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip


class LoopHistogram:
    """A histogram updated from the event loop thread only: no lock, a bisect
    and two additions per observation (prometheus_client's costs ~5x more,
    which shows at one observation per streamed token)."""

    def __init__(self, name: str, help_text: str, bounds_s: tuple[float, ...]) -> None:
        self.name, self.help_text, self.bounds = name, help_text, bounds_s
        self.counts = [0] * (len(bounds_s) + 1)  # last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(
            self.name, self.help_text, buckets=self.buckets(), sum_value=self.sum
        )

    def buckets(self) -> list[tuple[str, int]]:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else _le(bound), cumulative))
        return buckets


class PathHistogram:
    """One ``LoopHistogram`` per request path, exported as one family with a
    ``path`` label: ``remote`` (prefilled on a prefill engine, KV handed to
    decode) or ``local`` (prefilled where it decodes: colocated, or short
    prompts under conditional disaggregation)."""

    def __init__(self, name: str, help_text: str, bounds_s: tuple[float, ...]) -> None:
        self.name, self.help_text, self.bounds = name, help_text, bounds_s
        self.by_path = {path: LoopHistogram(name, help_text, bounds_s) for path in PATHS}

    def observe(self, value: float, path: str) -> None:
        self.by_path[path].observe(value)

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.help_text, labels=["path"])
        for path, histogram in self.by_path.items():
            family.add_metric([path], histogram.buckets(), histogram.sum)
        return family


PATHS = ("local", "remote")


class GatewayMetrics(Collector):
    """Request-level metrics, written by the gateway on its event loop and
    read by the ``/metrics`` handler on the same loop."""

    def __init__(self) -> None:
        self.time_to_first_token = PathHistogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Arrival at the gateway to the first generated token.",
            _TTFT_BUCKETS_S,
        )
        self.inter_token_latency = PathHistogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between consecutive token-bearing engine outputs of a request.",
            _ITL_BUCKETS_S,
        )
        self.e2e_request_latency = PathHistogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Arrival at the gateway to the request's last output.",
            _REQUEST_BUCKETS_S,
        )
        self.request_queue_time = LoopHistogram(
            f"{PREFIX}request_queue_time_seconds",
            "Arrival at the gateway to dispatch to the backend (parse, tokenize, admit).",
            _REQUEST_BUCKETS_S,
        )
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_in_flight = 0
        self.num_finished: dict[str, int] = {}  # finish reason -> requests
        self.num_rejected: dict[str, int] = {}  # HTTP status code -> requests

    def finished(self, reason: str) -> None:
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1

    def rejected(self, status_code: int) -> None:
        key = str(status_code)
        self.num_rejected[key] = self.num_rejected.get(key, 0) + 1

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for histogram in (
            self.time_to_first_token,
            self.inter_token_latency,
            self.e2e_request_latency,
            self.request_queue_time,
        ):
            yield histogram.family()
        yield CounterMetricFamily(
            f"{PREFIX}prompt_tokens",
            "Prompt tokens of dispatched requests.",
            value=self.num_prompt_tokens,
        )
        yield CounterMetricFamily(
            f"{PREFIX}generation_tokens",
            "Generated tokens received.",
            value=self.num_generation_tokens,
        )
        finished = CounterMetricFamily(
            f"{PREFIX}request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            labels=["finished_reason"],
        )
        for reason, count in sorted(self.num_finished.items()):
            finished.add_metric([reason], count)
        yield finished
        rejected = CounterMetricFamily(
            f"{PREFIX}request_rejected",
            "Generation requests answered with an HTTP error before dispatch.",
            labels=["status_code"],
        )
        for code, count in sorted(self.num_rejected.items()):
            rejected.add_metric([code], count)
        yield rejected
        yield GaugeMetricFamily(
            f"{PREFIX}num_requests_in_flight",
            "Requests dispatched to the backend and not finished.",
            value=self.num_requests_in_flight,
        )


# Per-engine metrics taken from SchedulerStats: (name, help, kind, attribute).
_SCHEDULER_STATS = (
    ("num_requests_running", "Requests in the engine's running batch.", "gauge", "num_running_reqs"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "gauge", "num_waiting_reqs"),
    (
        "num_requests_waiting_for_remote_kvs",
        "Requests waiting for KV from a prefill engine.",
        "gauge",
        "num_waiting_for_remote_kvs",
    ),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", "gauge", "kv_cache_usage"),
    (
        "kv_blocks_held_for_transfer",
        "Blocks kept alive until a decode engine has read them.",
        "gauge",
        "num_blocks_held_for_transfer",
    ),
    ("num_preemptions", "Preemptions.", "counter", "num_preemptions"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter", "prefix_cache_hits"),
    (
        "prompt_tokens_computed",
        "Prompt tokens the engine computed (not cached, not received).",
        "counter",
        "num_prompt_tokens",
    ),
)  # fmt: skip

# Help text for the connector metrics engines report by name.
_KNOWN_HELP = {
    "kv_transfer_bytes": "Bytes of KV read from peers.",
    "kv_transfer_descriptors": "NIXL descriptors transferred.",
    "kv_transfer_failures": "KV transfers that failed.",
    "kv_notify_failures": "Transfer notifications that failed.",
    "kv_transfer_seconds": "Duration of one request's KV transfer.",
}

_LABELS = ("engine", "role")
# Names already exported from SchedulerStats; ignored in the by-name dicts.
_RESERVED = frozenset(name for name, *_ in _SCHEDULER_STATS)


class EngineMetricsCollector(Collector):
    """Reads ``backend.metrics_snapshot()`` at every scrape (no cached copies)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def describe(self) -> list[Metric]:
        return []  # names depend on the snapshot; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        snapshot = self._backend.metrics_snapshot()
        yield from _scheduler_families(snapshot.engines)
        yield from _named_families(snapshot.engines)
        decisions = CounterMetricFamily(
            f"{PREFIX}disagg_decisions",
            "Router decisions: prefill on a remote engine or locally on decode.",
            labels=["path"],
        )
        for path, count in sorted(snapshot.num_disagg_decisions.items()):
            decisions.add_metric([path], count)
        yield decisions
        yield from router_families(snapshot, PREFIX)
        yield from _socket_families(snapshot)


def _scheduler_families(engines: list[EngineMetrics]) -> Iterator[Metric]:
    for name, help_text, kind, attribute in _SCHEDULER_STATS:
        family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = family_type(f"{PREFIX}{name}", help_text, labels=_LABELS)
        for engine in engines:
            value = getattr(engine.scheduler_stats, attribute)
            family.add_metric([engine.engine_id, engine.role], value)
        yield family


def _named_families(engines: list[EngineMetrics]) -> Iterator[Metric]:
    counters: dict[str, CounterMetricFamily] = {}
    gauges: dict[str, GaugeMetricFamily] = {}
    histograms: dict[str, HistogramMetricFamily] = {}
    for engine in engines:
        labels = [engine.engine_id, engine.role]
        for name, value in engine.counters.items():
            base = name.removesuffix("_total")
            if base in _RESERVED:
                continue
            if base not in counters:
                counters[base] = CounterMetricFamily(
                    f"{PREFIX}{base}", _KNOWN_HELP.get(base, base), labels=_LABELS
                )
            counters[base].add_metric(labels, value)
        for name, value in engine.gauges.items():
            if name in _RESERVED:
                continue
            if name not in gauges:
                gauges[name] = GaugeMetricFamily(
                    f"{PREFIX}{name}", _KNOWN_HELP.get(name, name), labels=_LABELS
                )
            gauges[name].add_metric(labels, value)
        for name, hist in engine.histograms.items():
            if name not in histograms:
                histograms[name] = HistogramMetricFamily(
                    f"{PREFIX}{name}", _KNOWN_HELP.get(name, name), labels=_LABELS
                )
            buckets = [
                (_le(bound), count)
                for bound, count in zip(hist.bucket_upper_bounds, hist.bucket_counts, strict=True)
            ]
            buckets.append(("+Inf", hist.count))
            histograms[name].add_metric(labels, buckets, hist.sum)
    yield from counters.values()
    yield from gauges.values()
    yield from histograms.values()


def _socket_families(snapshot: BackendMetrics) -> Iterator[Metric]:
    """Per internal-plane socket: ``engine`` is the engine id, or "gateway"
    for the gateway's own output socket."""
    for name, help_text, attribute in (
        ("malformed_frames", "Malformed ZMQ messages dropped, by socket.", "malformed_frames"),
        ("auth_failures", "Peers refused at the CURVE handshake, by socket.", "auth_failures"),
    ):
        family = CounterMetricFamily(f"{PREFIX}{name}", help_text, labels=["socket", "engine"])
        for socket, count in sorted(getattr(snapshot, attribute).items()):
            family.add_metric([socket, "gateway"], count)
        for engine in snapshot.engines:
            for socket, count in sorted(getattr(engine, attribute).items()):
                family.add_metric([socket, engine.engine_id], count)
        yield family


def _le(bound: float) -> str:
    return repr(float(bound))


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of everything in ``registry``."""
    return generate_latest(registry)
