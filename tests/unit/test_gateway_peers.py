"""Several gateways' figures (``cluster/observability/gateway_peers.py``):
each publishes its slice; ``/metrics`` families carry every gateway's
samples labelled ``gateway``, ``/cluster/state`` counters are their sums,
and a restarted gateway continues its predecessor's counters."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

from tandem.cluster.observability.gateway_peers import GatewayPeers, cluster_counters
from tandem.cluster.observability.metrics import GatewayMetrics


def gateway(tmp_path, index: int, finished: int, in_flight: int) -> GatewayPeers:
    m = GatewayMetrics()
    for _ in range(finished):
        m.finished("length")
        m.time_to_first_token.observe(0.01, "remote")
    m.num_generation_tokens = 10 * finished
    m.num_requests_in_flight = in_flight
    return GatewayPeers(str(tmp_path), index, m)


def test_every_gateway_answers_for_all_of_them(tmp_path):
    a, b = gateway(tmp_path, 0, 3, 1), gateway(tmp_path, 1, 5, 2)
    a.publish(), b.publish()
    for peers in (a, b):
        rows = peers.gateway_rows()
        assert [r["index"] for r in rows] == [0, 1] and all(r["live"] for r in rows)
        assert cluster_counters(rows) == {
            "requests_in_flight": 3,
            "finished": {"length": 8},
            "rejected": {},
        }
        registry = CollectorRegistry()
        registry.register(peers)
        text = generate_latest(registry).decode()
        assert 'tandem:request_success_total{finished_reason="length",gateway="0"} 3.0' in text
        assert 'tandem:request_success_total{finished_reason="length",gateway="1"} 5.0' in text
        assert 'tandem:generation_tokens_total{gateway="1"} 50.0' in text
        assert text.count("# TYPE tandem:time_to_first_token_seconds histogram") == 1


def test_restarted_gateway_continues_its_counters_and_a_stale_one_has_nothing_in_flight(
    tmp_path, monkeypatch
):
    gateway(tmp_path, 0, 3, 1).publish()
    b = gateway(tmp_path, 1, 5, 2)
    b.publish()
    again = gateway(tmp_path, 1, 1, 0)  # gateway 1 died and was started again
    assert again.counters()["finished"] == {"length": 6}
    assert again.counters()["generation_tokens"] == 60
    later = time.time() + 60
    monkeypatch.setattr(time, "time", lambda: later)
    rows = again.gateway_rows()
    assert rows[0]["live"] is False and rows[0]["requests_in_flight"] == 0
    assert cluster_counters(rows)["finished"] == {"length": 9}
