"""Several gateways' figures (``cluster/observability/gateway_peers.py``):
each publishes its slice; ``/metrics`` families carry every gateway's
samples labelled ``gateway``, ``/cluster/state`` counters are their sums,
and a restarted gateway continues its predecessor's counters."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

from tandem.cluster.observability.dashboard.rolling import RollingStats
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rolling_window_is_the_clusters_on_every_gateway(tmp_path):
    """Each gateway's /cluster/state window counts every gateway's requests;
    a restarted gateway continues its predecessor's figures."""
    clock = FakeClock()
    peers, rolling, metrics = [], [], []
    for index in range(2):
        m = GatewayMetrics()
        p = GatewayPeers(str(tmp_path), index, m)
        r = RollingStats(m, peers=p, interval_s=2.0, window_s=60.0, clock=clock, wall=clock)
        p.published["rolling"] = r.cumulative
        peers.append(p), rolling.append(r), metrics.append(m)

    def tick() -> None:
        for p in peers:
            p.publish()
        for r in rolling:
            r.sample()

    tick()
    for m, (tokens, ttft_s) in zip(metrics, [(40, 0.01), (60, 0.5)], strict=True):
        for _ in range(10):
            m.time_to_first_token.observe(ttft_s, "local")
        m.num_generation_tokens += tokens
        m.finished("stop")
    clock.now += 2.0
    tick()
    for r in rolling:
        (point,) = r.series()
        assert point.tokens_out_per_s == 50.0  # (40 + 60) tokens over 2 s
        assert point.requests_per_s == 1.0
        # half the first tokens at 10 ms (gateway 0), half at 500 ms (gateway 1)
        assert point.ttft_p50_s <= 0.025 and point.ttft_p99_s >= 0.25
    # gateway 1 restarts: it continues from what its predecessor published
    metrics[1] = GatewayMetrics()
    peers[1] = GatewayPeers(str(tmp_path), 1, metrics[1])
    rolling[1] = RollingStats(
        metrics[1], peers=peers[1], interval_s=2.0, window_s=60.0, clock=clock, wall=clock
    )
    peers[1].published["rolling"] = rolling[1].cumulative
    metrics[0].num_generation_tokens += 20
    clock.now += 2.0
    tick()
    assert rolling[0].series()[-1].tokens_out_per_s == 10.0  # gateway 0's 20 tokens over 2 s
    assert rolling[0].window().tokens_out_per_s == 120 / 4.0
    assert rolling[1].series() == []  # the new gateway's ring starts with its first sample
    metrics[1].num_generation_tokens += 30
    clock.now += 2.0
    tick()
    assert rolling[0].series()[-1].tokens_out_per_s == 15.0
    assert rolling[1].series()[-1].tokens_out_per_s == 15.0
    # a stale or damaged file adds nothing and breaks nothing
    (tmp_path / "gateway-7.json").write_text('{"index": 7, "rolling": {"ttft": 3}}')
    clock.now += 2.0
    tick()
    assert rolling[0].series()[-1].tokens_out_per_s == 0.0
