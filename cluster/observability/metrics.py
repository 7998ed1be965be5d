"""Prometheus metrics of the gateway and, read at scrape time, of the engines.

Names follow vLLM's under the ``tandem:`` prefix (ARCHITECTURE §6). Two kinds:

* request-level, measured in the gateway (``GatewayMetrics``): TTFT, ITL,
  end-to-end histograms, token and request counters (the per-phase ones,
  from the engines' timings, are in ``cluster/observability/tracing/phase_metrics.py``);
* engine-level, labelled ``engine`` and ``role``, copied from
  ``Backend.metrics_snapshot()`` by ``EngineMetricsCollector`` at each scrape.

Both are ``Collector``s read at scrape time. Each app owns a
``CollectorRegistry``, so several gateways can live in one process (tests)
without clashing in the global registry.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tandem.cluster.gateway.backend import Backend, BackendMetrics, EngineMetrics
from tandem.cluster.observability.kv_offload_metrics import offload_families
from tandem.cluster.observability.scaling_metrics import scaling_families
from tandem.cluster.routing.metrics import router_families
from tandem.scheduler.engine_stats import Histogram, prometheus_buckets

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


class LoopHistogram(Histogram):
    """A named ``scheduler.engine_stats.Histogram`` (the one histogram
    implementation): observed and read on the gateway's event loop only."""

    def __init__(self, name: str, help_text: str, bounds_s: tuple[float, ...]) -> None:
        super().__init__(bounds_s)
        self.name, self.help_text = name, help_text

    def family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(
            self.name, self.help_text, buckets=self.buckets(), sum_value=self.sum
        )

    def buckets(self) -> list[tuple[str, int]]:
        return prometheus_buckets(self.snapshot())


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
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_in_flight = 0
        self.num_finished: dict[str, int] = {}  # finish reason -> requests
        self.num_rejected: dict[str, int] = {}  # HTTP status code -> requests
        # (time.time(), request id, message) of the latest failed requests
        self.recent_failures: collections.deque[tuple[float, str, str]] = collections.deque(
            maxlen=50
        )

    def finished(self, reason: str) -> None:
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1

    def request_failed(self, request_id: str, message: str) -> None:
        """A request ended with an engine/backend error (``/cluster/state``)."""
        self.recent_failures.append((time.time(), request_id, message))

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
        yield counter_by(
            "request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            "finished_reason",
            self.num_finished,
        )
        yield counter_by(
            "request_rejected",
            "Generation requests answered with an HTTP error before dispatch.",
            "status_code",
            self.num_rejected,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}num_requests_in_flight",
            "Requests dispatched to the backend and not finished.",
            value=self.num_requests_in_flight,
        )


# Per-engine families: (name, help, kind, value of an EngineMetrics).
_ENGINE_FAMILIES: tuple[tuple[str, str, str, Callable[[EngineMetrics], float]], ...] = (
    ("num_requests_running", "Requests in the engine's running batch.", "gauge",
     lambda e: e.stats.scheduler.num_running_reqs),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "gauge",
     lambda e: e.stats.scheduler.num_waiting_reqs),
    ("num_requests_waiting_for_remote_kvs", "Requests waiting for KV from a prefill engine.",
     "gauge", lambda e: e.stats.scheduler.num_waiting_for_remote_kvs),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", "gauge",
     lambda e: e.stats.scheduler.kv_cache_usage),
    ("kv_blocks_held_for_transfer", "Blocks kept alive until a decode engine has read them.",
     "gauge", lambda e: e.stats.scheduler.num_blocks_held_for_transfer),
    ("num_preemptions", "Preemptions.", "counter", lambda e: e.stats.scheduler.num_preemptions),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter",
     lambda e: e.stats.scheduler.prefix_cache_queries),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter",
     lambda e: e.stats.scheduler.prefix_cache_hits),
    ("prompt_tokens_computed", "Prompt tokens the engine computed (not cached, not received).",
     "counter", lambda e: e.stats.scheduler.num_prompt_tokens),
    ("engine_steps", "Engine loop steps.", "counter", lambda e: e.stats.num_steps),
    ("engine_last_step_seconds", "Duration of the engine's latest step.", "gauge",
     lambda e: e.stats.last_step_s),
    ("engine_epoch", "Incarnation the gateway is connected to (time_ns at actor start).",
     "gauge", lambda e: e.epoch),
    ("engine_ready", "1 when the router may send the engine requests.", "gauge",
     lambda e: float(e.ready)),
    ("engine_restarts", "Times the engine came back with a new epoch.", "counter",
     lambda e: e.num_restarts),
    ("engine_output_backlog_messages", "Outputs the engine holds because the gateway is behind.",
     "gauge", lambda e: e.stats.output_backlog_messages),
    ("engine_streams_cut", "Streams the engine ended because its outputs were not read.",
     "counter", lambda e: e.stats.num_streams_cut),
)  # fmt: skip

# Families of engines with a KV connector: (name, help, kind, field of KVTransferStats).
_KV_FAMILIES = (
    ("kv_transfer_bytes", "Bytes of KV read from peers.", "counter", "transfer_bytes_total"),
    ("kv_transfer_descriptors", "NIXL descriptors transferred.", "counter",
     "transfer_descriptors_total"),
    ("kv_transfer_failures", "KV transfers that failed.", "counter", "transfer_failures_total"),
    ("kv_transfer_notification_failures", "Transfer notifications that failed.", "counter",
     "notification_failures_total"),
    ("kv_lease_expiries", "Held blocks freed because their lease expired.", "counter",
     "lease_expiries_total"),
    ("kv_quarantined_loads", "Loads whose READ NIXL could not cancel.", "counter",
     "quarantined_loads_total"),
    ("kv_loads_in_flight", "KV reads in flight.", "gauge", "loads_in_flight"),
    ("kv_loads_in_quarantine", "Loads now waiting for an uncancellable READ.", "gauge",
     "loads_in_quarantine"),
)  # fmt: skip

_LABELS = ("engine", "role")


class EngineMetricsCollector(Collector):
    """Reads ``backend.metrics_snapshot()`` at every scrape (no cached copies)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def describe(self) -> list[Metric]:
        return []  # read at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        snapshot = self._backend.metrics_snapshot()
        yield from _engine_families(snapshot.engines)
        yield from _kv_families(snapshot.engines)
        yield from _structured_families(snapshot.engines)
        yield from offload_families(snapshot.engines)
        yield from _spec_decode_families(snapshot.engines)
        yield counter_by(
            "disagg_decisions",
            "Router decisions: prefill on a remote engine or locally on decode.",
            "path",
            snapshot.num_disagg_decisions,
        )
        for name, help_text, value in (
            ("streams_cut", "Streams cut because the client did not read its outputs.",
             snapshot.num_streams_cut),
            ("orphans_aborted", "Requests aborted on an engine that came back after being "
             "declared dead.", snapshot.num_orphans_aborted),
            ("output_reader_restarts", "Restarts of the gateway's output reader.",
             snapshot.num_reader_restarts),
        ):  # fmt: skip
            yield CounterMetricFamily(f"{PREFIX}{name}", help_text, value=value)
        yield from router_families(snapshot, PREFIX)
        yield counter_by(
            "migrations",
            "Streams moved to another engine (cluster/disagg/migration.py), by reason.",
            "reason",
            snapshot.num_migrations,
        )
        yield from _socket_families(snapshot)
        yield from scaling_families(snapshot)


def counter_by(name: str, help_text: str, label: str, counts: dict) -> CounterMetricFamily:
    """A `tandem:<name>_total` counter with one label, a sample per key of `counts`."""
    family = CounterMetricFamily(f"{PREFIX}{name}", help_text, labels=[label])
    for key, count in sorted(counts.items()):
        family.add_metric([str(key)], count)
    return family


def _engine_families(engines: list[EngineMetrics]) -> Iterator[Metric]:
    for name, help_text, kind, value in _ENGINE_FAMILIES:
        family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = family_type(f"{PREFIX}{name}", help_text, labels=_LABELS)
        for engine in engines:
            family.add_metric([engine.engine_id, engine.role], value(engine))
        yield family


def _kv_families(engines: list[EngineMetrics]) -> Iterator[Metric]:
    with_kv = [(e, e.stats.kv_transfer) for e in engines if e.stats.kv_transfer is not None]
    for name, help_text, kind, field in _KV_FAMILIES:
        family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = family_type(f"{PREFIX}{name}", help_text, labels=_LABELS)
        for engine, kv in with_kv:
            family.add_metric([engine.engine_id, engine.role], getattr(kv, field))
        yield family
    transfer = HistogramMetricFamily(
        f"{PREFIX}kv_transfer_seconds", "Duration of one request's KV read.", labels=_LABELS
    )
    for engine, kv in with_kv:
        if kv.transfer_seconds is not None:
            snap = kv.transfer_seconds
            transfer.add_metric([engine.engine_id, engine.role], prometheus_buckets(snap), snap.sum)
    yield transfer
    yield from _kv_transport_families(with_kv)


# Structured outputs (workers/structured/manager.py): (name, help, field of StructuredOutputStats)
_STRUCTURED_COUNTERS = (
    ("structured_output_requests", "Requests with an output constraint.",
     "constrained_requests_total"),
    ("structured_output_cache_hits", "Grammar compiles answered by the cache (or one in flight).",
     "cache_hits_total"),
    ("structured_output_cache_misses", "Grammars compiled.", "cache_misses_total"),
    ("structured_output_compile_failures", "Grammars refused or past the compile deadline.",
     "compile_failures_total"),
)  # fmt: skip
_STRUCTURED_HISTOGRAMS = (
    ("structured_output_compile_seconds", "Duration of one grammar compile.", "compile_seconds"),
    ("structured_output_mask_seconds", "Filling one step's grammar bitmask rows.", "mask_seconds"),
)


def _structured_families(engines: list[EngineMetrics]) -> Iterator[Metric]:
    """Every engine that reports them (all of this version's)."""
    with_so = [(e, e.stats.structured) for e in engines if e.stats.structured is not None]
    for name, help_text, field in _STRUCTURED_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}{name}", help_text, labels=_LABELS)
        for engine, so in with_so:
            family.add_metric([engine.engine_id, engine.role], getattr(so, field))
        yield family
    for name, help_text, field in _STRUCTURED_HISTOGRAMS:
        family = HistogramMetricFamily(f"{PREFIX}{name}", help_text, labels=_LABELS)
        for engine, so in with_so:
            snap = getattr(so, field)
            if snap is not None:
                family.add_metric(
                    [engine.engine_id, engine.role], prometheus_buckets(snap), snap.sum
                )
        yield family


# Speculative decoding, vLLM's names: (name, help, field of SchedulerStats).
_SPEC_FAMILIES = (
    ("spec_decode_num_drafts", "Steps of a request that carried drafts.",
     "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     "spec_decode_num_accepted_tokens"),
)  # fmt: skip


def _spec_decode_families(engines: list[EngineMetrics]) -> Iterator[Metric]:
    """Engines with speculative decoding only (an engine without never drafts)."""
    speculating = [e for e in engines if e.stats.scheduler.spec_decode_num_accepted_tokens_per_pos]
    for name, help_text, field in _SPEC_FAMILIES:
        family = CounterMetricFamily(f"{PREFIX}{name}", help_text, labels=_LABELS)
        for engine in speculating:
            family.add_metric(
                [engine.engine_id, engine.role], getattr(engine.stats.scheduler, field)
            )
        yield family
    per_pos = CounterMetricFamily(
        f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=[*_LABELS, "position"],
    )
    for engine in speculating:
        counts = engine.stats.scheduler.spec_decode_num_accepted_tokens_per_pos or ()
        for position, count in enumerate(counts):
            per_pos.add_metric([engine.engine_id, engine.role, str(position)], count)
    yield per_pos


def _kv_transport_families(with_kv: list) -> Iterator[Metric]:
    """What UCX picked for READs into each engine (start-up probe,
    kvtransfer/ucx/probe.py); engines whose probe has not run are absent."""
    info = GaugeMetricFamily(
        f"{PREFIX}kv_transport_info",
        "1 per engine: the UCX transport of KV READs into it (start-up probe).",
        labels=[*_LABELS, "transport", "path", "memory"],
    )
    slow = GaugeMetricFamily(
        f"{PREFIX}kv_transport_slow",
        "1 when the probe found VRAM KV READs going over TCP or emulated in software.",
        labels=_LABELS,
    )
    for engine, kv in with_kv:
        if kv.transport:
            labels = [engine.engine_id, engine.role]
            info.add_metric([*labels, kv.transport, kv.transport_path, kv.transport_memory], 1.0)
            slow.add_metric(labels, float(kv.transport_slow))
    yield info
    yield slow


def _socket_families(snapshot: BackendMetrics) -> Iterator[Metric]:
    """Per internal-plane socket: ``engine`` is the engine id, or "gateway"
    for the gateway's own sockets (and the stats it decodes, ``engine_stats``)."""
    for name, help_text in (
        ("malformed_frames", "Malformed ZMQ messages dropped, by socket."),
        ("auth_failures", "Peers refused at the CURVE handshake, by socket."),
    ):
        family = CounterMetricFamily(f"{PREFIX}{name}", help_text, labels=["socket", "engine"])
        for socket, count in sorted(getattr(snapshot, name).items()):
            family.add_metric([socket, "gateway"], count)
        for engine in snapshot.engines:
            for socket, count in sorted(getattr(engine.stats.wire, name).items()):
                family.add_metric([socket, engine.engine_id], count)
        yield family


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of everything in ``registry``."""
    return generate_latest(registry)
