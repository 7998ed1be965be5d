"""Prometheus families of the in-flight counts the gateways share
(``cluster/routing/peer_load.py``), read from ``BackendMetrics.peer_load``.

Per gateway: each gateway holds its own view of the others, so with
``--api-server-count N`` these are among the families every gateway shows
for all N with a ``gateway="<i>"`` label (``gateway_peers.py``). With one
gateway they are there too, unlabelled, at 0 (no peers), so dashboards and
alerts need no second shape:

    tandem:peer_gateways_live                     peers whose record has not expired
    tandem:peer_load_oldest_record_age_seconds    the oldest of those records' age (0: none)
    tandem:peer_load_records_sent_total           records sent to peers (one per peer per send)
    tandem:peer_load_records_received_total       peers' records decoded
    tandem:peer_load_records_expired_total        peers' records forgotten for their age
    tandem:peer_load_dropped_total{reason}        bad_datagram | send_refused | queue_full

The cluster-wide per-engine figures the router scores with
(``tandem:router_requests_in_flight``, ``tandem:router_queued_prefill_tokens``)
are the engine collector's (``cluster/routing/metrics.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.cluster.gateway.backend import DROP_REASONS, Backend, PeerLoadStats

PREFIX = "tandem:"


def peer_load_families(stats: PeerLoadStats | None) -> Iterator[Metric]:
    """The families of one gateway's ``stats`` (None: a lone gateway, all 0)."""
    stats = stats or PeerLoadStats(gateway=0, expire_after_s=0.0)
    yield GaugeMetricFamily(
        f"{PREFIX}peer_gateways_live",
        "Other gateways whose in-flight record this gateway holds (not expired).",
        value=len(stats.peers),
    )
    yield GaugeMetricFamily(
        f"{PREFIX}peer_load_oldest_record_age_seconds",
        "Age of the oldest live peer gateway's in-flight record (0 with none).",
        value=max((p.age_s for p in stats.peers), default=0.0),
    )
    for name, help_text, value in (
        ("records_sent", "In-flight records sent to peer gateways.", stats.num_records_sent),
        ("records_received", "Peer gateways' in-flight records decoded.",
         stats.num_records_received),
        ("records_expired", "Peer gateways' in-flight records forgotten for their age.",
         stats.num_records_expired),
    ):  # fmt: skip
        yield CounterMetricFamily(f"{PREFIX}peer_load_{name}", help_text, value=value)
    dropped = CounterMetricFamily(
        f"{PREFIX}peer_load_dropped",
        "In-flight datagrams lost: bad_datagram (received, no peer's record), send_refused "
        "(a peer's socket refused it), queue_full (a peer's queue full: sent again later).",
        labels=["reason"],
    )
    for reason in sorted({*DROP_REASONS, *stats.num_dropped}):
        dropped.add_metric([reason], stats.num_dropped.get(reason, 0))
    yield dropped


class PeerLoadCollector(Collector):
    """This gateway's ``peer_load_families``, read at every scrape."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from peer_load_families(self._backend.metrics_snapshot().peer_load)
