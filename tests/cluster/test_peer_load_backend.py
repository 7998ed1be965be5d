"""The in-flight counts of one gateway's backend reach another gateway's
router (``cluster/routing/peer_load.py``), without Ray: RayBackend over two
fake engines on the real ZMQ data plane (``test_migration_backend.py``'s),
sharing through ``ClusterRouting.share_load`` as ``tandem serve`` does in
each of ``--api-server-count``'s gateways; the other gateway is its real
channel and router on the same loop. Both sides' counts per engine, and the
live peers, as ``/cluster/state`` and ``/metrics`` show them."""

from __future__ import annotations

import asyncio
import tempfile

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.cluster.disagg.migration import MigrationPolicy
from tandem.cluster.observability.dashboard.rolling import RollingStats
from tandem.cluster.observability.dashboard.state import cluster_state
from tandem.cluster.observability.metrics import EngineMetricsCollector, GatewayMetrics
from tandem.cluster.observability.peer_load_metrics import PeerLoadCollector
from tandem.cluster.routing.peer_load import PeerLoadChannel
from tandem.cluster.routing.policy import RoutingConfig
from tandem.wire.engine_protocol import FinishReason
from tests.cluster.test_migration_backend import (
    PROMPT,
    Client,
    first_engine,
    request,
    with_backend,
)
from tests.unit.test_peer_load import make_router


def test_a_request_in_flight_on_one_gateway_counts_on_the_others():
    async def scenario(backend, engines) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30

        async def until(cond, what: str) -> None:
            while not cond():
                assert loop.time() < deadline, what
                await asyncio.sleep(0.005)

        with tempfile.TemporaryDirectory(prefix="pl-") as share_dir:
            other = PeerLoadChannel(share_dir, 1, make_router())
            other.start()
            try:
                assert backend.routing.share_load(share_dir, 0) is not None
                client = Client(backend, request())
                engine, req = await first_engine(engines)
                eid = engine.engine_id
                st = other.router.engines[eid]
                # sent, no output yet: one request and its whole prompt queued
                await until(lambda: (st.peer_inflight, st.peer_queued_prefill_tokens) == (1, 4),
                            "the other gateway does not see the request")  # fmt: skip
                assert len(PROMPT) == 4 and backend.router.engines[eid].peer_inflight == 0
                # the other gateway's own two requests there, as this one shows them
                other.router.engines[eid].num_inflight = 2
                other.router.engines[eid].queued_prefill_tokens = 10
                other.changed()
                await until(lambda: backend.router.engines[eid].peer_inflight == 2, "no count")
                shown_as(backend, eid, here=(1, 4), peers=(2, 10), peer_gateways=[(1, 2)])
                backend.routing.peer_load.check_integrity()
                other.check_integrity()
                other.router.engines[eid].num_inflight = 0
                other.router.engines[eid].queued_prefill_tokens = 0
                other.changed()
                await until(lambda: backend.router.engines[eid].peer_inflight == 0, "no count")
                await engine.send(req.request_id, [3])  # the first output: prefill done
                await until(lambda: st.peer_queued_prefill_tokens == 0, "queued tokens stay")
                assert st.peer_inflight == 1
                await engine.send(req.request_id, [4, 5], FinishReason.LENGTH)
                await asyncio.wait_for(client.task, 30)
                await until(lambda: st.peer_inflight == 0, "the ended request stays")
                other.close()  # its goodbye: this gateway forgets it at once
                await until(lambda: not backend.metrics_snapshot().peer_load.peers, "no goodbye")
                shown_as(backend, eid, here=(0, 0), peers=(0, 0), peer_gateways=[])
                backend.routing.peer_load.check_integrity()
            finally:
                other.close()

    asyncio.run(with_backend(MigrationPolicy(), scenario, routing=RoutingConfig()))


def shown_as(backend, eid: str, here: tuple, peers: tuple, peer_gateways: list) -> None:
    """Engine ``eid``'s (requests in flight, queued prefill tokens), this
    gateway's and its peers', on ``/cluster/state`` and ``/metrics``; the live
    peers as (index, requests in flight)."""
    metrics = GatewayMetrics()
    state = cluster_state(backend, metrics, RollingStats(metrics))
    row = next(e for e in state.engines if e.id == eid)
    assert (row.requests_in_flight_here, row.queued_prefill_tokens_here) == here
    assert (row.requests_in_flight_peers, row.queued_prefill_tokens_peers) == peers
    total = (here[0] + peers[0], here[1] + peers[1])
    assert (row.requests_in_flight, row.queued_prefill_tokens) == total
    assert state.peer_load.gateway == 0
    assert [(p.index, p.requests_in_flight) for p in state.peer_load.peers] == peer_gateways
    assert all(0 <= p.age_s < state.peer_load.expire_after_s for p in state.peer_load.peers)
    registry = CollectorRegistry()
    registry.register(EngineMetricsCollector(backend))
    registry.register(PeerLoadCollector(backend))
    samples = {
        (s.name, s.labels.get("engine")): s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }
    assert samples["tandem:router_requests_in_flight", eid] == total[0]
    assert samples["tandem:router_queued_prefill_tokens", eid] == total[1]
    assert samples["tandem:peer_gateways_live", None] == len(peer_gateways)
