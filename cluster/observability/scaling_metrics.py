"""Elastic pools on ``/metrics`` (``cluster/disagg/scaling.py``, the planner):

    tandem:pool_engines{pool}                              gauge: engines in the pool now
    tandem:scaling_actions_total{pool, action, outcome}    engines started / stopped /
                                                           moved in (action "move")
    tandem:planner_decisions_total{pool, action, reason}   the running planner's decisions

A gateway that does not own its pools (``--attach``) reports the sizes it
sees and no actions.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tandem.cluster.gateway.backend import BackendMetrics

PREFIX = "tandem:"


def scaling_families(snapshot: BackendMetrics) -> Iterator[Metric]:
    sizes = GaugeMetricFamily(
        f"{PREFIX}pool_engines",
        "Engines in each pool (starting ones not counted).",
        labels=["pool"],
    )
    for pool, n in sorted(snapshot.pool_sizes.items()):
        sizes.add_metric([pool], n)
    yield sizes
    yield _by_three(
        "scaling_actions",
        "Engines a pool resize started (scale_out) or stopped (scale_in), or that moved "
        "into the pool from the other one (move), by outcome.",
        ("pool", "action", "outcome"),
        snapshot.scaling_actions,
    )
    planner = snapshot.planner.decisions if snapshot.planner is not None else {}
    yield _by_three(
        "planner_decisions",
        "Decisions of the running planner (--planner), per pool, by action and reason.",
        ("pool", "action", "reason"),
        planner,
    )


def _by_three(name: str, help_text: str, labels: tuple, counts: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}{name}", help_text, labels=list(labels))
    for key, n in sorted(counts.items()):
        family.add_metric(key.split("/", 2), n)
    return family
