"""``tandem:kv_offload_*``: the engines' KV tiers below the device cache
(``kvtransfer/tiers/``), from each engine's ``EngineStats.kv_offload``.

Per engine and tier (``medium`` = host | disk): bytes stored and loaded, blocks
loaded back (hits), evictions, bytes used and capacity; per engine: the store
queue depth, loads in flight, failures by reason and the load time histogram.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from tandem.cluster.gateway.backend import EngineMetrics
from tandem.scheduler.engine_stats import prometheus_buckets

PREFIX = "tandem:kv_offload_"

# (name, help, kind, field of KVOffloadTierStats)
_TIER_FAMILIES = (
    ("stored_bytes", "Bytes of KV stored into a tier below the device cache.", "counter",
     "stored_bytes_total"),
    ("loaded_bytes", "Bytes of KV loaded back from a tier into the device cache.", "counter",
     "loaded_bytes_total"),
    ("hits", "KV blocks loaded back from a tier (prefix hits below the device).", "counter",
     "hits_total"),
    ("evictions", "KV blocks a tier evicted to make room.", "counter", "evictions_total"),
    ("used_bytes", "Bytes of KV a tier holds.", "gauge", "used_bytes"),
    ("capacity_bytes", "Bytes of KV a tier may hold.", "gauge", "capacity_bytes"),
)  # fmt: skip


def offload_families(engines: list[EngineMetrics]) -> Iterator[Metric]:
    with_tiers = [(e, e.stats.kv_offload) for e in engines if e.stats.kv_offload is not None]
    labels = ["engine", "role", "medium"]
    for name, help_text, kind, field in _TIER_FAMILIES:
        family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = family_type(PREFIX + name, help_text, labels=labels)
        for engine, off in with_tiers:
            for tier in off.tiers:
                family.add_metric(
                    [engine.engine_id, engine.role, tier.medium], getattr(tier, field)
                )
        yield family
    queue = GaugeMetricFamily(
        PREFIX + "store_queue_depth",
        "KV block stores waiting for the tier thread.",
        labels=["engine", "role"],
    )
    loads = GaugeMetricFamily(
        PREFIX + "loads_in_flight",
        "Requests waiting for KV from a tier.",
        labels=["engine", "role"],
    )
    failures = CounterMetricFamily(
        PREFIX + "failures",
        "KV tier failures by reason (a failed or late load is recomputed; a dropped, cancelled "
        "or refused store is only a lost chance of a hit).",
        labels=["engine", "role", "reason"],
    )
    seconds = HistogramMetricFamily(
        PREFIX + "load_seconds",
        "Duration of one request's load from the KV tiers.",
        labels=["engine", "role"],
    )
    for engine, off in with_tiers:
        key = [engine.engine_id, engine.role]
        queue.add_metric(key, off.store_queue_depth)
        loads.add_metric(key, off.loads_in_flight)
        for reason, value in sorted(off.failures_total.items()):
            failures.add_metric([*key, reason], value)
        if off.load_seconds is not None:
            snap = off.load_seconds
            seconds.add_metric(key, prometheus_buckets(snap), snap.sum)
    yield from (queue, loads, failures, seconds)
