"""Typed engine stats, the one histogram, rolling windows, and the
``/cluster/state`` + ``/dashboard`` routes against a ``NullBackend`` (no
engines: fast). The same routes against a live 1P+1D service, and the page
in a real browser, are in test_operator_views.py."""

from __future__ import annotations

import time

import httpx
import msgspec
import openai
import pytest

from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.cluster.observability.dashboard.rolling import RollingStats
from tandem.cluster.observability.metrics import GatewayMetrics
from tandem.scheduler.engine_stats import (
    STATS_DECODER,
    EngineStats,
    Histogram,
    HistogramSnapshot,
    KVTransferStats,
    quantile,
)
from tandem.wire.engine_protocol import SchedulerStats
from tandem.wire.frames import MalformedFrame, decode
from tandem.workers.checkpoints.tiny import build_tokenizer

STATE_KEYS = {
    "time_s", "model", "ready", "not_ready_reason", "pools", "engines", "window", "series",
    "counters", "recent_errors", "gateways", "scaling", "scaling_actions", "planner",
    "peer_load", "pool_moves",
}  # fmt: skip
ENGINE_KEYS = {
    "id", "role", "epoch", "state", "ready", "running", "waiting", "waiting_for_remote_kv",
    "kv_usage", "blocks_held", "transfers_in_flight", "restarts", "last_error", "steps",
    "last_step_s", "preemptions", "prefix_cache_queries", "prefix_cache_hits", "kv_tiers",
    "spec_acceptance", "requests_in_flight", "queued_prefill_tokens", "requests_in_flight_here",
    "queued_prefill_tokens_here", "requests_in_flight_peers", "queued_prefill_tokens_peers",
}  # fmt: skip
WINDOW_KEYS = {
    "time_s", "span_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
    "tokens_in_per_s", "tokens_out_per_s", "requests_per_s",
}  # fmt: skip


def test_histogram_snapshot_is_cumulative_like_prometheus():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0, 3.0):
        h.observe(v)
    assert h.snapshot() == HistogramSnapshot([0.1, 1.0], [2, 3], 5, 5.65)
    with pytest.raises(ValueError, match="increase"):
        Histogram((1.0, 0.5))


def test_quantile_interpolates_inside_buckets():
    snap = HistogramSnapshot([1.0, 2.0, 3.0, 4.0], [25, 50, 75, 100], 100, 0.0)
    assert quantile(snap, 0.5) == pytest.approx(2.0)
    assert quantile(snap, 0.99) == pytest.approx(3.96)
    assert quantile(snap, 0.1) == pytest.approx(0.4)
    assert quantile(HistogramSnapshot([1.0], [0], 0), 0.5) is None
    above = HistogramSnapshot([1.0, 2.0], [0, 0], 3)  # all in +Inf
    assert quantile(above, 0.5) == 2.0


def test_engine_stats_round_trip_and_validation():
    stats = EngineStats(
        "decode-0",
        "decode",
        7,
        num_steps=3,
        last_step_s=0.01,
        scheduler=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5),
        num_transfers_in_flight=1,
        kv_transfer=KVTransferStats(loads_in_flight=1),
    )
    assert decode(STATS_DECODER, msgspec.msgpack.encode(stats)) == stats
    for bad in (
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"engine_id": "x"}),  # role, epoch missing
        msgspec.msgpack.encode({"engine_id": "x", "role": "decode", "epoch": "7"}),
        msgspec.msgpack.encode({"engine_id": "x", "role": "decode", "epoch": 1, "extra": 1}),
    ):
        with pytest.raises(MalformedFrame):
            decode(STATS_DECODER, bad)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rolling_stats_windows_the_cumulative_metrics():
    metrics, clock = GatewayMetrics(), FakeClock()
    rolling = RollingStats(metrics, interval_s=2.0, window_s=10.0, clock=clock, wall=clock)
    assert rolling.window() is None and rolling.series() == []
    rolling.sample()
    for _ in range(10):
        metrics.time_to_first_token.observe(0.03, "remote")
        metrics.inter_token_latency.observe(0.004, "local")
    metrics.num_prompt_tokens += 100
    metrics.num_generation_tokens += 40
    metrics.finished("stop")
    clock.now += 2.0
    rolling.sample()
    (point,) = rolling.series()
    assert point.span_s == 2.0 and point.time_s == clock.now
    assert 0.02 <= point.ttft_p50_s <= 0.04 and 0.0025 <= point.itl_p99_s <= 0.005
    assert (point.tokens_in_per_s, point.tokens_out_per_s, point.requests_per_s) == (50, 20, 0.5)
    clock.now += 2.0
    rolling.sample()  # nothing happened in this interval
    quiet = rolling.series()[-1]
    assert quiet.ttft_p50_s is None and quiet.tokens_out_per_s == 0
    assert rolling.window().tokens_out_per_s == 10.0  # 40 tokens over 4 s
    clock.now += 20.0
    rolling.sample()  # the old samples fall out of the 10 s window
    assert rolling.window().tokens_out_per_s == 0 and len(rolling.series()) == 0
    with pytest.raises(ValueError, match="window_s"):
        RollingStats(metrics, interval_s=5.0, window_s=5.0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_cluster_state_shape_and_values_move(tokenizer):
    backend = NullBackend(tokenizer)
    with serve_in_thread(create_app(backend)) as url, httpx.Client(timeout=30) as http:
        before = http.get(url + "/cluster/state")
        assert before.status_code == 200
        assert before.headers["content-type"] == "application/json"
        state = before.json()
        assert set(state) == STATE_KEYS
        assert state["gateways"] == []  # one gateway: no per-gateway rows
        assert state["peer_load"] is None  # nor in-flight counts shared with peers
        assert state["model"] == backend.model_name and state["ready"] is True
        (engine,) = state["engines"]
        assert set(engine) == ENGINE_KEYS
        assert (engine["id"], engine["role"], engine["state"]) == ("null-0", "colocated", "alive")
        assert state["pools"] == [
            {"role": "colocated", "engines": 1, "ready": 1, "running": 0, "waiting": 0}
        ]
        assert set(state["window"]) == WINDOW_KEYS
        assert state["window"]["tokens_out_per_s"] == 0
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for _ in range(3):
            client.completions.create(model=backend.model_name, prompt="hello", max_tokens=8)
        after = http.get(url + "/cluster/state").json()
        assert after["window"]["tokens_out_per_s"] > 0
        assert after["window"]["ttft_p50_s"] is not None
        assert after["counters"]["finished"] == {"length": 3}
        assert after["time_s"] >= state["time_s"]


def test_failed_requests_are_recent_errors(tokenizer):
    backend = NullBackend(tokenizer)
    backend.fail_after_num_tokens = 0
    with serve_in_thread(create_app(backend)) as url, httpx.Client(timeout=30) as http:
        r = http.post(url + "/v1/completions", json={"model": backend.model_name, "prompt": "x"})
        assert r.status_code == 500
        errors = http.get(url + "/cluster/state").json()["recent_errors"]
        assert [e["message"] for e in errors] == ["injected"]
        assert errors[0]["source"].startswith("request ")
        assert time.time() - 60 < errors[0]["time_s"] <= time.time()


def test_api_key_guards_the_state_not_the_page(tokenizer):
    backend = NullBackend(tokenizer)
    with (
        serve_in_thread(create_app(backend, api_key="sekrit")) as url,
        httpx.Client(timeout=30) as http,
    ):
        refused = http.get(url + "/cluster/state")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = http.get(url + "/cluster/state", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = http.get(url + "/cluster/state", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json()["engines"][0]["id"] == "null-0"
        page = http.get(url + "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        html = page.text
        assert 'fetch("/cluster/state"' in html and "Authorization" in html
        assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in html  # nothing loaded from elsewhere


def test_metrics_expose_the_backend_recovery_counters(tokenizer):
    backend = NullBackend(tokenizer)
    with serve_in_thread(create_app(backend)) as url:
        text = httpx.get(url + "/metrics", timeout=30).text
    for line in (
        "tandem:streams_cut_total 0.0",
        "tandem:orphans_aborted_total 0.0",
        "tandem:output_reader_restarts_total 0.0",
        'tandem:engine_steps_total{engine="null-0",role="colocated"} 0.0',
        'tandem:engine_epoch{engine="null-0",role="colocated"} 1.0',
    ):
        assert line in text, line
