"""Operator views of a live 1 prefill + 1 decode service (tiny model, local
Ray): every metric family docs/architecture.md lists is on ``/metrics``
with its labels on every engine; ``/cluster/state`` moves under load; and
``/dashboard`` renders in a real headless Chromium (and, fed the state of a
gateway with peers, splits each engine's in-flight count and names them)."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.service_helpers import client, tiny_pd_service, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {"prefill-0": "prefill", "decode-0": "decode"}
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # >= 32 tokens: remote
# Families whose samples exist only once something happened on a socket.
ONLY_WHEN_COUNTED = {
    "tandem:malformed_frames_total",
    "tandem:auth_failures_total",
    "tandem:scaling_actions_total",  # a resize happened
    "tandem:planner_decisions_total",  # --planner load|sla
}


def documented_families() -> list[tuple[str, str, list[str]]]:
    """``(name, type, labels)`` rows of the metrics table in docs/architecture.md."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(tandem:[a-z_:]+)` \| (\w+) \| ([^|]*)\|$", doc, re.M)
    assert len(rows) >= 30, "the metrics table in docs/architecture.md was not found"
    return [(name, kind, re.findall(r"`(\w+)`", labels)) for name, kind, labels in rows]


@pytest.fixture(scope="module")
def svc():
    with tiny_pd_service(disagg_min_tokens=32) as service:
        yield service
        wait_idle(service)


class Load(threading.Thread):
    """Completions back to back from ``num_clients`` threads until stopped;
    remote (long prompt) and local (short) alternate."""

    def __init__(self, svc, num_clients: int = 3) -> None:
        super().__init__(daemon=True)
        self.svc, self.num_clients = svc, num_clients
        self.stop = threading.Event()
        self.num_done = 0
        self.errors: list[BaseException] = []

    def run(self) -> None:
        def worker(i: int) -> None:
            c = client(self.svc, timeout_s=60)
            n = 0
            while not self.stop.is_set():
                prompt = LONG_PROMPT if (n + i) % 2 == 0 else f"hello {n}"
                try:
                    c.completions.create(model="tiny", prompt=prompt, max_tokens=16)
                    self.num_done += 1
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    self.errors.append(exc)
                    return
                n += 1

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(self.num_clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(90)

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(120)
        assert not self.is_alive(), "load threads did not stop"
        assert not self.errors, self.errors


def state(svc, **headers) -> dict:
    r = httpx.get(svc.base_url + "/cluster/state", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(condition, deadline_s: float, what: str):
    end = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < end, f"{what}: not within {deadline_s} s"
        time.sleep(0.25)


def test_every_documented_family_is_exposed_with_its_labels(svc):
    with Load(svc) as load:
        wait_for(lambda: load.num_done >= 6, 90, "six completions")
    bad = httpx.post(svc.base_url + "/v1/completions", json={"model": "tiny"}, timeout=30)
    assert bad.status_code == 400  # one rejected request: request_rejected has a sample
    text = httpx.get(svc.base_url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind, labels in documented_families():
        family_name = name.removesuffix("_total") if kind == "counter" else name
        assert family_name in families, f"{name} is documented but not exposed"
        family = families[family_name]
        assert family.type == kind, f"{name}: {family.type}, documented {kind}"
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        if name not in ONLY_WHEN_COUNTED:
            assert samples, f"{name} has no sample"
        for sample in samples:
            assert set(labels) <= set(sample.labels), f"{name}: {sample.labels}"
        if {"engine", "role"} <= set(labels):  # per engine: every engine
            seen = {(s.labels["engine"], s.labels["role"]) for s in samples}
            assert seen == set(ENGINES.items()), f"{name}: {seen}"


def test_cluster_state_moves_under_load(svc):
    before = state(svc)
    assert {e["id"]: e["role"] for e in before["engines"]} == ENGINES
    for e in before["engines"]:
        assert e["epoch"] > 0 and e["state"] == "alive" and e["ready"] and e["restarts"] == 0
    assert [(p["role"], p["engines"], p["ready"]) for p in before["pools"]] == [
        ("decode", 1, 1),
        ("prefill", 1, 1),
    ]
    finished_before = sum(before["counters"]["finished"].values())
    steps_before = {e["id"]: e["steps"] for e in before["engines"]}
    with Load(svc) as load:
        wait_for(lambda: load.num_done >= 6, 90, "six completions")

        # the health task refreshes engine stats every 0.5 s
        def stepped() -> dict | None:
            s = state(svc)
            return s if all(e["steps"] > steps_before[e["id"]] for e in s["engines"]) else None

        moved = wait_for(stepped, 30, "engine steps reported")
        wait_for(lambda: state(svc)["series"], 30, "a chart point")
    after = state(svc)
    assert moved["engines"][0]["kv_usage"] >= 0
    window = after["window"]
    assert window["tokens_out_per_s"] > 0 and window["tokens_in_per_s"] > 0
    assert window["requests_per_s"] > 0
    assert 0 < window["ttft_p50_s"] <= window["ttft_p99_s"]
    assert 0 < window["itl_p50_s"] <= window["itl_p99_s"]
    assert sum(after["counters"]["finished"].values()) >= finished_before + 6
    assert any(p["tokens_out_per_s"] > 0 for p in after["series"])
    assert after["recent_errors"] == []


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Where the screenshot goes (docs/dashboard.png is one taken this way).
SCREENSHOT_ENV = "TANDEM_DASHBOARD_SCREENSHOT"


def test_dashboard_renders_in_headless_chromium(svc, tmp_path):
    """The page as a browser runs it: its script polls /cluster/state and
    fills the tables and charts; asserted on the rendered DOM."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian package `chromium`; `make test` installs it)")
    from playwright.sync_api import sync_playwright

    screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "dashboard.png")
    with Load(svc) as load:
        wait_for(lambda: load.num_done >= 6, 90, "six completions")
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"),  # a fresh user-data-dir
                executable_path=str(CHROMIUM),
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 1000},
            )
            try:
                page = context.new_page()
                page.goto(svc.base_url + "/dashboard?interval_ms=500", timeout=30_000)
                page.wait_for_function(
                    """() => document.querySelectorAll('#engines tr[data-engine-id]').length === 2
                        && parseFloat(document.getElementById('tokens-out-per-s').textContent) > 0
                        && document.querySelector('#chart-tokens path[data-series="out"]')""",
                    timeout=30_000,
                )
                time.sleep(2.5)  # a few more polls: the charts get several points
                ids = page.eval_on_selector_all(
                    "#engines tr[data-engine-id]", "rows => rows.map(r => r.dataset.engineId)"
                )
                cells = page.eval_on_selector_all(
                    "#engines td.engine-id", "cells => cells.map(c => c.textContent)"
                )
                tokens_out = float(page.text_content("#tokens-out-per-s"))
                tokens_in = float(page.text_content("#tokens-in-per-s"))
                states = page.eval_on_selector_all(
                    "#engines tr td:nth-child(4)", "cells => cells.map(c => c.textContent)"
                )
                status = page.text_content("#status")
                out_line = page.get_attribute('#chart-tokens path[data-series="out"]', "d")
                page.screenshot(path=str(screenshot), full_page=True)
            finally:
                context.close()
    assert sorted(ids) == sorted(cells) == sorted(ENGINES)
    assert tokens_out > 0 and tokens_in > 0
    assert states == ["alive", "alive"] and status == "ready"
    assert out_line.count("L") >= 1, out_line  # a line through at least two points
    assert screenshot.stat().st_size > 10_000


def test_dashboard_shows_the_peer_gateways_split(tmp_path):
    """With several gateways (``peer_load`` set) the engine rows split the
    router's in-flight figure into this gateway's + its peers', and a line
    names the live peers: the page of a ``NullBackend`` gateway whose state
    answer is that of a gateway with one peer (the browser's fetch answered
    from the test)."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian package `chromium`)")
    from playwright.sync_api import sync_playwright

    from tandem.cluster.gateway.app import create_app, serve_in_thread
    from tandem.cluster.gateway.null_backend import NullBackend
    from tandem.workers.checkpoints.tiny import build_tokenizer

    with serve_in_thread(create_app(NullBackend(build_tokenizer()))) as url:
        body = httpx.get(url + "/cluster/state", timeout=30).json()
        assert body["peer_load"] is None
        body["engines"][0].update(
            requests_in_flight=3, requests_in_flight_here=1, requests_in_flight_peers=2
        )
        peer = {"index": 1, "pid": 4321, "age_s": 0.125, "requests_in_flight": 2}
        body["peer_load"] = {"gateway": 0, "expire_after_s": 2.0, "peers": [peer]}
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"),
                executable_path=str(CHROMIUM),
                headless=True,
                args=CHROMIUM_ARGS,
            )
            try:
                page = context.new_page()
                page.route("**/cluster/state", lambda route: route.fulfill(json=body))
                page.goto(url + "/dashboard", timeout=30_000)
                page.wait_for_function(
                    "() => document.querySelector('#engines td.in-flight')", timeout=30_000
                )
                cell = page.text_content("#engines td.in-flight")
                line = page.text_content("#peer-load")
            finally:
                context.close()
    assert cell == "3 (1 + 2)"
    assert line == "gateway 0; live peers: 1 (0.13 s old, 2 in flight)"
