"""Prometheus families of the router (read from ``BackendMetrics``):

tandem:router_decisions_total{role,reason}   engine choices; role "route"
    counts the disaggregation plan (remote_prefill, decode_holds_prompt,
    tiers_hold_prompt, small_miss, short_prompt, no_prefill); role "tier_lend"
    the gateway's asks for a peer's host-tier prefix (lent, none, failed:
    cluster/disagg/tier_lending.py)
tandem:router_prefix_hit_error_tokens         predicted - reported prefix
    hit of the engine that computed the prompt (kv-aware only)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from tandem.cluster.gateway.backend import BackendMetrics
from tandem.scheduler.engine_stats import prometheus_buckets


def router_families(snapshot: BackendMetrics, prefix: str) -> Iterator[Metric]:
    decisions = CounterMetricFamily(
        f"{prefix}router_decisions",
        "Router decisions by pool role and reason.",
        labels=["role", "reason"],
    )
    for key, count in sorted(snapshot.router_decisions.items()):
        role, _, reason = key.partition("/")
        decisions.add_metric([role, reason], count)
    yield decisions
    hist = snapshot.prefix_hit_error
    if hist is not None:
        family = HistogramMetricFamily(
            f"{prefix}router_prefix_hit_error_tokens",
            "Predicted minus engine-reported prefix-hit tokens per routed request.",
        )
        family.add_metric([], prometheus_buckets(hist), hist.sum)
        yield family
