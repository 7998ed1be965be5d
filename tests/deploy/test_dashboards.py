"""The Grafana dashboards the chart ships (helm/tandem/dashboards/*.json):
Grafana's dashboard JSON model, PromQL that parses (promql-parser), and
every metric they query exposed by a running 1P+1D service's /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.service_helpers import tiny_pd_service, wait_idle

DASHBOARDS = Path(__file__).resolve().parents[2] / "helm" / "tandem" / "dashboards"
TITLES = {
    "tandem-overview.json": "Tandem / Overview",
    "tandem-prefill-decode.json": "Tandem / Prefill-Decode",
}
# Grafana's built-in interval variable; everything else in our PromQL is plain.
GRAFANA_VARIABLES = {"$__rate_interval": "5m"}

pytestmark = pytest.mark.shared_ray


def load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """Names of every series selector in ``expr`` (``foo_bucket`` included)."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    names: set[str] = set()

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_the_two_dashboards_exist():
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(TITLES)


@pytest.mark.parametrize("name", sorted(TITLES))
def test_dashboard_json_model(name):
    """The fields Grafana's dashboard model requires, with their types, and a
    layout inside the 24-column grid with no overlapping panels."""
    board = load(name)
    assert board["title"] == TITLES[name]
    assert isinstance(board["uid"], str) and 0 < len(board["uid"]) <= 40
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert isinstance(board["version"], int)
    assert set(board["time"]) == {"from", "to"}
    assert isinstance(board["templating"]["list"], list)
    assert any(v["type"] == "datasource" for v in board["templating"]["list"])
    ids, cells = set(), set()
    assert board["panels"]
    for panel in board["panels"]:
        assert isinstance(panel["id"], int) and panel["id"] not in ids
        ids.add(panel["id"])
        assert panel["type"] == "timeseries" and panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in ("h", "w", "x", "y"))
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        area = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(set(ref_ids)) == len(ref_ids)
        assert "unit" in panel["fieldConfig"]["defaults"]


def test_every_expression_parses_and_names_tandem_metrics():
    for name in TITLES:
        for expr in exprs(load(name)):
            names = metric_names(expr)
            assert names and all(n.startswith("tandem:") for n in names), expr


def test_extractor_finds_every_selector_and_rejects_bad_promql():
    expr = (
        "histogram_quantile(0.9, sum by (le) (rate(tandem:a_bucket[$__rate_interval])))"
        ' / on() group_left() sum(tandem:b{engine=~"$engine"}) + tandem:c offset 5m'
    )
    assert metric_names(expr) == {"tandem:a_bucket", "tandem:b", "tandem:c"}
    with pytest.raises(Exception):  # noqa: B017 - the parser's own error type
        metric_names("sum(rate(tandem:a[5m])")


def test_the_issue_panels_are_there():
    overview = " ".join(exprs(load("tandem-overview.json")))
    for needed in (
        "tandem:request_success_total",
        "tandem:request_rejected_total",
        "sum by (le, path) (rate(tandem:time_to_first_token_seconds_bucket",
        "sum by (le, path) (rate(tandem:inter_token_latency_seconds_bucket",
        "sum by (le, path) (rate(tandem:e2e_request_latency_seconds_bucket",
        "tandem:prompt_tokens_total",
        "tandem:generation_tokens_total",
        "sum by (role) (tandem:num_requests_running)",
        "sum by (role) (tandem:num_requests_waiting)",
        "tandem:streams_cut_total",
        "tandem:orphans_aborted_total",
        "tandem:output_reader_restarts_total",
        "tandem:engine_restarts_total",
        "tandem:peer_gateways_live",
        "tandem:peer_load_oldest_record_age_seconds",
        "tandem:peer_load_dropped_total",
    ):
        assert needed in overview, needed
    pd = " ".join(exprs(load("tandem-prefill-decode.json")))
    for needed in (
        "tandem:kv_cache_usage_perc",
        "tandem:kv_blocks_held_for_transfer",
        "tandem:kv_loads_in_flight",
        "tandem:kv_transfer_bytes_total",
        "tandem:kv_transfer_seconds_bucket",
        "tandem:kv_transfer_failures_total",
        "tandem:kv_lease_expiries_total",
        "tandem:prefix_cache_hits_total",
        "tandem:num_preemptions_total",
        "tandem:disagg_decisions_total",
        "tandem:engine_last_step_seconds",
        "tandem:kv_offload_used_bytes",
        "tandem:kv_offload_capacity_bytes",
        "tandem:kv_offload_stored_bytes_total",
        "tandem:kv_offload_loaded_bytes_total",
        "tandem:kv_offload_hits_total",
        "tandem:kv_offload_evictions_total",
        "tandem:kv_offload_load_seconds_bucket",
        "tandem:kv_offload_store_queue_depth",
        "tandem:kv_offload_loads_in_flight",
        "tandem:kv_offload_failures_total",
        "tandem:router_requests_in_flight",
        "tandem:router_queued_prefill_tokens",
    ):
        assert needed in pd, needed


@pytest.mark.slow
def test_every_queried_metric_is_exposed_by_a_running_service():
    """A real 1 prefill + 1 decode service on a local Ray, fed one remote and
    one local request and one rejected one; then every name the dashboards
    query is a sample of /metrics, and latencies carry both paths. The engines
    have host KV tiers, whose ``tandem:kv_offload_*`` families the dashboard shows."""
    with tiny_pd_service(disagg_min_tokens=32, kv_offloading_size=0.01) as svc:
        client = openai.OpenAI(
            base_url=svc.base_url + "/v1", api_key="x", max_retries=0, timeout=60
        )
        long_prompt = "the quick brown fox " * 16  # >= 32 tokens: remote prefill
        client.completions.create(model="tiny", prompt=long_prompt, max_tokens=4)
        client.completions.create(model="tiny", prompt="hi", max_tokens=4)  # local
        bad = httpx.post(svc.base_url + "/v1/completions", json={"model": "tiny"}, timeout=30)
        assert bad.status_code == 400
        text = httpx.get(svc.base_url + "/metrics", timeout=30).text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        wait_idle(svc)
    exposed = {s.name for s in samples}
    queried = {n for name in TITLES for e in exprs(load(name)) for n in metric_names(e)}
    assert queried - exposed == set()
    ttft_paths = {
        s.labels["path"]: s.value
        for s in samples
        if s.name == "tandem:time_to_first_token_seconds_count"
    }
    assert ttft_paths == {"remote": 1.0, "local": 1.0}
    engines = {s.labels["engine"] for s in samples if s.name == "tandem:kv_loads_in_flight"}
    assert engines == {"prefill-0", "decode-0"}
