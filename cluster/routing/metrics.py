"""Prometheus families of the router (read from ``BackendMetrics``):

tandem:router_decisions_total{role,reason}   engine choices; role "route"
    counts the disaggregation plan (remote_prefill, decode_holds_prompt,
    tiers_hold_prompt, small_miss, short_prompt, no_prefill); role "tier_lend"
    the gateway's asks for a peer's host-tier prefix (lent, none, failed:
    cluster/disagg/tier_lending.py)
tandem:router_prefix_hit_error_tokens         predicted - reported prefix
    hit of the engine that computed the prompt (kv-aware only)
tandem:router_requests_in_flight{engine,role}
tandem:router_queued_prefill_tokens{engine,role}
    what the router scores each engine with: every gateway's requests not
    ended there (and their predicted uncached prompt tokens not yet
    prefilled), this gateway's live plus the others' as they last published
    them (peer_load.py). Cluster-wide: the same on every gateway within the
    sharing delay, so these carry no ``gateway`` label.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

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
    for name, help_text, value in (
        ("router_requests_in_flight",
         "Requests not ended on the engine, every gateway's, as the router scores it.",
         lambda e: e.num_inflight + e.peer_inflight),
        ("router_queued_prefill_tokens",
         "Predicted uncached prompt tokens sent to the engine and not yet prefilled, every "
         "gateway's, as the router scores it.",
         lambda e: e.queued_prefill_tokens + e.peer_queued_prefill_tokens),
    ):  # fmt: skip
        family = GaugeMetricFamily(f"{prefix}{name}", help_text, labels=["engine", "role"])
        for engine in snapshot.engines:
            family.add_metric([engine.engine_id, engine.role], value(engine))
        yield family
