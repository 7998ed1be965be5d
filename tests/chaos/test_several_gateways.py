"""Several gateways over one engine fleet (``tandem serve --api-server-count
N``, ``cluster/cli/gateways.py``) over 1 prefill + 1 decode engine (tiny): N = 3 here
(one dies while two serve on, so the survivors are several too); N = 2 on its own
local Ray at the end.

A fourth gateway joins the same engines on its own port (``--attach``) and
gives the single-gateway reference. Through the shared port the kernel
spreads connections over all N gateways (``/health`` names the one that
answered); every stream is token-identical to the reference and the engines
idle with 0 blocks and pass check_integrity(). One gateway is SIGKILLed with
long streams in flight on every gateway (each stream on a keep-alive
connection whose gateway ``/health`` named first): the streams on the others
complete identical, its own break, the engines drop it with its requests
(0 blocks held), and the supervisor starts it again: the new one joins and
serves, the others are undisturbed."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.cluster.engines.attach import find_engines, stop_engines
from tests.chaos.gateway_proc import GatewayProcess, gateway_env
from tests.chaos.harness import ENGINE, StreamResult, Workload, request_body, verdict
from tests.chaos.service import settle_engines, stats

pytestmark = pytest.mark.slow

PER_GATEWAY = 4  # long streams pinned to each gateway when one is killed
LONG_TOKENS = 900  # the survivors' long streams: identical to the single gateway's
# The killed gateway's streams never complete, so they need no reference and can be far
# longer: however fast the engines decode, they are still generating when it is killed
# and when the engines drop it (2 s later) and abort them. Hence the fleet's engines take
# 4096 positions (the tiny model's) and KV for all without preempting any.
KILLED_TOKENS = 3900
FLEET_ENGINE = {**ENGINE, "num_kv_blocks": 2048, "max_model_len": 4096}


def gateways_seen(url: str, tries: int = 60) -> set[int]:
    seen = set()
    for _ in range(tries):  # a new connection each time: the kernel picks a gateway
        body = httpx.get(url + "/health", timeout=10).json()
        seen.add(body.get("gateway"))
    return seen


def wait_log(proc: GatewayProcess, pattern: str, count: int, deadline_s: float = 300.0) -> list:
    end = time.monotonic() + deadline_s
    while True:
        found = re.findall(pattern, proc.log())
        if len(found) >= count:
            return found
        assert proc.proc.poll() is None, proc.log()
        assert time.monotonic() < end, f"{pattern!r} x{count} not in:\n{proc.log()}"
        time.sleep(0.25)


def wait_cluster_counters(url: str, n: int, finished: int, deadline_s: float = 60.0) -> dict:
    """Until every one of the ``n`` gateways (fresh connections: the kernel
    picks one; ``peer_load.gateway`` names it) answers ``/cluster/state`` with
    ``finished`` requests cluster-wide, nothing in flight, and ``n`` gateway
    rows that sum to the totals."""
    end = time.monotonic() + deadline_s
    while True:
        answers = {}
        for _ in range(30):
            body = httpx.get(url + "/cluster/state", timeout=10).json()
            answers[body["peer_load"]["gateway"]] = body
        ok = len(answers) == n and all(
            b["counters"]["finished"] == {"length": finished}
            and b["counters"]["requests_in_flight"] == 0
            and len(b["gateways"]) == n
            and sum(r["finished"].get("length", 0) for r in b["gateways"]) == finished
            for b in answers.values()
        )
        if ok:
            return answers
        assert time.monotonic() < end, {g: b["counters"] for g, b in answers.items()}
        time.sleep(0.5)


def wait_peers_live(url: str, n: int, deadline_s: float = 60.0) -> dict:
    """Until every one of the ``n`` gateways answers ``/cluster/state`` with
    the other ``n - 1`` as live peers of the shared in-flight counts; returns
    gateway index -> its ``peer_load``."""
    end = time.monotonic() + deadline_s
    while True:
        views = {}
        for _ in range(30):
            view = httpx.get(url + "/cluster/state", timeout=10).json()["peer_load"]
            views[view["gateway"]] = view
        ok = len(views) == n and all(
            [p["index"] for p in v["peers"]] == sorted(set(range(n)) - {g})
            for g, v in views.items()
        )
        if ok:
            return views
        assert time.monotonic() < end, views
        time.sleep(0.25)


class HeldStreams:
    """``num`` streamed completions, each on its own connection (the kernel
    picks its gateway), read until ``release``: then the client closes them
    (each gateway aborts its own). ``max_tokens`` keeps them running meanwhile."""

    def __init__(self, base_url: str, num: int, max_tokens: int) -> None:
        self.url = base_url + "/v1/completions"
        self.started = [threading.Event() for _ in range(num)]
        self.release = threading.Event()
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._run, args=(i, max_tokens), daemon=True)
            for i in range(num)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int, max_tokens: int) -> None:
        try:
            body = request_body("greedy", i, max_tokens=max_tokens)
            with httpx.stream("POST", self.url, json=body, timeout=120) as r:
                if r.status_code != 200:
                    self.errors.append(f"stream {i}: HTTP {r.status_code}")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.started[i].set()
                    if self.release.is_set():
                        return
            self.errors.append(f"stream {i} ended before its release")
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(f"stream {i}: {exc!r}")

    def wait_started(self, deadline_s: float = 60.0) -> None:
        end = time.monotonic() + deadline_s
        for i, ev in enumerate(self.started):
            assert ev.wait(max(end - time.monotonic(), 0)), (i, self.errors)

    def close(self) -> None:
        self.release.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "a held stream did not close"


def wait_engine_in_flight(url: str, n: int, engine: str, num: int, deadline_s: float = 60.0):
    """Until every one of the ``n`` gateways (fresh connections: the kernel
    picks one; ``peer_load.gateway`` names it) answers ``/cluster/state`` with
    ``num`` requests in flight on ``engine`` cluster-wide, its own and its
    peers' adding up, each gateway's own count being the others' peer count,
    every other gateway live, and ``num`` in flight in the gateways' counters.
    Returns gateway index -> that engine's row."""
    end = time.monotonic() + deadline_s
    while True:
        rows, peers, counters = {}, {}, {}
        for _ in range(30):
            body = httpx.get(url + "/cluster/state", timeout=10).json()
            g = body["peer_load"]["gateway"]
            rows[g] = next(e for e in body["engines"] if e["id"] == engine)
            peers[g] = [p["index"] for p in body["peer_load"]["peers"]]
            counters[g] = body["counters"]["requests_in_flight"]
        here = sum(r["requests_in_flight_here"] for r in rows.values())
        ok = (
            len(rows) == n
            and here == num
            and all(
                r["requests_in_flight"] == num
                and r["requests_in_flight_peers"] == num - r["requests_in_flight_here"]
                and peers[g] == sorted(set(range(n)) - {g})
                and counters[g] == num
                for g, r in rows.items()
            )
        )
        if ok:
            return rows
        assert time.monotonic() < end, (rows, peers, counters)
        time.sleep(0.25)


def metric_samples(url: str) -> dict[tuple, float]:
    """``/metrics`` of whichever gateway answers: (name, sorted labels) -> value."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def client_port(response: httpx.Response) -> int:
    """The local port of the connection that carried ``response``."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def connect_to(url: str, gateway: int, deadline_s: float = 60.0) -> tuple[httpx.Client, int]:
    """A client holding one keep-alive connection to ``gateway`` behind the
    shared port: new connections (the kernel picks each one's gateway) until
    ``/health`` over one names it. Returns the client and its connection's
    local port. Uvicorn closes a connection idle for 5 s: use it at once."""
    end = time.monotonic() + deadline_s
    while True:
        client = httpx.Client(timeout=180, limits=httpx.Limits(max_connections=1))
        r = client.get(url + "/health")
        if r.json()["gateway"] == gateway:
            return client, client_port(r)
        client.close()
        assert time.monotonic() < end, f"no connection to gateway {gateway}"


class PinnedStreams(Workload):
    """Greedy streams as ``Workload``'s, stream ``i`` on gateway
    ``gateways[i]`` (its thread connects until it has that gateway, then
    streams over the same connection) with ``max_tokens[i]``. ``ports[i]``:
    the local port of that connection and of the one that carried the stream
    (the same unless the client had to open another)."""

    def __init__(self, url: str, gateways: list[int], max_tokens: list[int]) -> None:
        self.base_url = url
        self.gateways = gateways
        self.max_tokens = max_tokens
        self.ports: list[tuple[int, int] | None] = [None] * len(gateways)
        super().__init__(url, "greedy", num_streams=len(gateways))

    def _run(self, result: StreamResult, body: dict) -> None:
        body = {**body, "max_tokens": self.max_tokens[result.index]}
        try:
            client, port = connect_to(self.base_url, self.gateways[result.index])
            with contextlib.closing(client), client.stream("POST", self.url, json=body) as r:
                self.ports[result.index] = (port, client_port(r))
                if r.status_code != 200:
                    result.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        result.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            result.error = chunk["error"]["message"]
                            continue
                        if chunk.get("usage"):
                            result.completion_tokens = chunk["usage"]["completion_tokens"]
                        for choice in chunk.get("choices", []):
                            tokens = (choice.get("logprobs") or {}).get("tokens") or []
                            result.tokens.extend(tokens)
                            result.token_times_s.extend([time.monotonic()] * len(tokens))
                            if choice.get("finish_reason"):
                                result.finish_reason = choice["finish_reason"]
        except Exception as exc:  # noqa: BLE001 - reported by the test
            result.exception = repr(exc)


def wait_own_in_flight(url: str, least: dict[int, int], deadline_s: float = 60.0) -> None:
    """Until each gateway ``g`` answers ``/cluster/state`` (over a connection
    to it) with at least ``least[g]`` of its own requests not ended on the
    decode engine (so it has not written their ends)."""
    control = {g: connect_to(url, g) for g in least}
    end = time.monotonic() + deadline_s
    try:
        while True:
            own = {}
            for g, (client, port) in control.items():
                r = client.get(url + "/cluster/state")
                if (r.json()["peer_load"]["gateway"], client_port(r)) != (g, port):
                    client.close()  # it had closed the idle connection: connect again
                    control[g] = connect_to(url, g)
                    continue
                rows = r.json()["engines"]
                own[g] = sum(e["requests_in_flight_here"] for e in rows if e["role"] == "decode")
            if all(own.get(g, -1) >= k for g, k in least.items()):
                return
            assert time.monotonic() < end, (own, least)
            time.sleep(0.05)
    finally:
        for client, _ in control.values():
            client.close()


def identical(w: Workload, ref: Workload) -> int:
    return sum(verdict(r, x, False) == "identical" for r, x in zip(w.results, ref.results))


def test_gateways_over_one_fleet_one_dies_and_comes_back(tmp_path, monkeypatch):
    import ray

    n = 3
    monkeypatch.setenv("TANDEM_HOST", "127.0.0.1")
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False, _node_ip_address="127.0.0.1")
    address = ray.get_runtime_context().gcs_address
    namespace = f"several-gw-{os.getpid()}"
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    common = [
        "--model", "tiny", "--address", address, "--ray-namespace", namespace,
        "--cluster-secret-file", str(secret), "--kv-lease-s", "10",
    ]  # fmt: skip
    engine = [
        "--num-kv-blocks", str(FLEET_ENGINE["num_kv_blocks"]),
        "--max-num-seqs", str(FLEET_ENGINE["max_num_seqs"]),
        "--max-model-len", str(FLEET_ENGINE["max_model_len"]),
        "--gateway-lost-after-s", "2",
    ]  # fmt: skip
    env = gateway_env()
    procs: list[GatewayProcess] = []
    try:
        fleet = GatewayProcess(
            [*common, "--prefill", "1", "--decode", "1", "--api-server-count", str(n), *engine],
            str(tmp_path / "fleet.log"),
            env,
        )
        procs.append(fleet)
        wait_log(fleet, r"gateway \d serving", n)
        pids = dict(
            (int(i), int(p))
            for i, p in re.findall(r"gateway (\d) started \(pid (\d+)\)", fleet.log())
        )
        assert sorted(pids) == list(range(n))
        fleet.wait_healthy(60)
        single = GatewayProcess([*common, "--attach"], str(tmp_path / "single.log"), env)
        procs.append(single)
        assert single.wait_healthy(180)["status"] == "ok"
        handles = find_engines(namespace)
        assert sorted(h.engine_id for h in handles) == ["decode-0", "prefill-0"]
        assert all(len(ray.get(h.actor.ready.remote())["gateways"]) == n + 1 for h in handles)

        refs = {w: Workload(single.url, w) for w in ("greedy", "seeded")}
        long_ref = Workload(
            single.url, "greedy", num_streams=n * PER_GATEWAY, max_tokens=LONG_TOKENS
        )
        for w in [*refs.values(), long_ref]:
            assert not any(w.finish())

        assert gateways_seen(fleet.url) == set(range(n))  # connections spread over all
        for name, ref in refs.items():
            w = Workload(fleet.url, name)
            assert not any(w.finish())
            assert identical(w, ref) == len(ref.results), [r for r in w.results]
        assert settle_engines(handles) == 0
        # every gateway answers with the cluster's counters; /metrics labels each gateway's
        answers = wait_cluster_counters(fleet.url, n, 32)
        per_gateway = {r["index"]: r["finished"]["length"] for r in answers[0]["gateways"]}
        assert all(k > 0 for k in per_gateway.values()), per_gateway  # spread over all
        text = httpx.get(fleet.url + "/metrics", timeout=10).text
        for g, k in per_gateway.items():
            line = f'tandem:request_success_total{{finished_reason="length",gateway="{g}"}} {k}.0'
            assert line in text, text

        # SIGKILL gateway 1 with long streams in flight on every gateway: stream i on
        # gateway i % n (its connection's); gateway 1's far longer than the others
        on = [i % n for i in range(n * PER_GATEWAY)]
        long = PinnedStreams(fleet.url, on, [KILLED_TOKENS if g == 1 else LONG_TOKENS for g in on])
        long.wait_tokens(4)
        assert all(len(r.tokens) >= 4 for r in long.results), long.results  # none ended
        # the kill follows gateway 1's own word that none of its streams has ended
        # (nor written its end) and the others' that they have streams running
        wait_own_in_flight(fleet.url, {0: 1, 1: PER_GATEWAY, 2: 1})
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        assert not any(long.finish())
        timeline = [  # per stream: its gateway, tokens, first and last against the kill
            (r.index, on[r.index], len(r.tokens), r.done,
             *(round(r.token_times_s[k] - killed_at, 3) for k in (0, -1) if r.token_times_s))
            for r in long.results
        ]  # fmt: skip
        assert all(p is not None and p[0] == p[1] for p in long.ports), (long.ports, timeline)
        for r, g in zip(long.results, on, strict=True):
            ref = long_ref.results[r.index]
            if g == 1:  # broke, after a prefix of the undisturbed tokens
                assert not r.done and (r.exception or r.error), (r, timeline)
                k = min(len(r.tokens), LONG_TOKENS)
                assert r.tokens[:k] == ref.tokens[:k], r
            else:
                assert verdict(r, ref, False) == "identical", (r, timeline)
        assert settle_engines(handles) == 0  # the dead gateway's requests were aborted
        aborted = {h.engine_id: stats(h).num_gateway_requests_aborted for h in handles}
        assert aborted == {"prefill-0": 0, "decode-0": PER_GATEWAY}, aborted

        # the supervisor starts it again: it joins and serves beside the others
        wait_log(fleet, r"gateway 1 serving", 2)
        end = time.monotonic() + 60
        while gateways_seen(fleet.url, 30) != set(range(n)):
            assert time.monotonic() < end, "the restarted gateway does not serve"
        # ... and shares its in-flight counts: the survivors had dropped the dead
        # one's record (its socket refused their sends, or it expired) and hold the
        # new one's
        views = wait_peers_live(fleet.url, n)
        assert next(p for p in views[0]["peers"] if p["index"] == 1)["pid"] != pids[1]
        for g in (0, 2):
            v = views[g]
            assert v["num_dropped"]["send_refused"] + v["num_records_expired"] >= 1, v
        w = Workload(fleet.url, "greedy")
        assert not any(w.finish())
        assert identical(w, refs["greedy"]) == len(w.results)
        assert settle_engines(handles) == 0

        assert single.stop() == 0, single.log()  # it leaves; the fleet serves on
        w = Workload(fleet.url, "seeded", num_streams=4)
        assert not any(w.finish())
        assert identical(w, refs["seeded"]) == 4
        assert fleet.stop() == 0, fleet.log()
        assert "tandem: stopped" in fleet.log()
    finally:
        for p in procs:
            p.crash()
        stop_engines(namespace)
        left = find_engines(namespace)
        ray.shutdown()
    assert left == []


def test_api_server_count_on_its_own_local_ray_with_a_generated_secret(tmp_path):
    """No --address and no secret file: the command starts Ray, the engines
    and two gateways that join that Ray with the secret it generated. Each
    gateway's router opened its socket for the shared in-flight counts in
    the supervisor's directory (cluster/routing/peer_load.py). With streams
    in flight both gateways' /cluster/state show the same cluster-wide
    counts per engine and /metrics the per-engine and per-gateway series;
    once the clients close them, nothing is in flight anywhere."""
    env = {k: v for k, v in gateway_env().items() if k != "RAY_ADDRESS"}
    env["TANDEM_HOST"] = "127.0.0.1"
    short_tmp = tempfile.mkdtemp(prefix="gw-")  # AF_UNIX paths: 108 bytes at most
    env["TMPDIR"] = short_tmp  # where the supervisor makes its share directory
    fleet = GatewayProcess(
        ["--model", "tiny", "--colocated", "1", "--api-server-count", "2", "--no-ray-dashboard"],
        str(tmp_path / "fleet.log"),
        env,
    )
    try:
        wait_log(fleet, r"gateway \d serving", 2)
        fleet.wait_healthy(120)
        assert gateways_seen(fleet.url) == {0, 1}
        sockets = glob.glob(os.path.join(short_tmp, "tandem-gw-*", "figures", "load-*.sock"))
        assert sorted(os.path.basename(p) for p in sockets) == ["load-0.sock", "load-1.sock"]
        # aborted by the client once checked (~2 s): 4000 tokens would take a minute or more
        held = HeldStreams(fleet.url, 4, max_tokens=4000)
        try:
            held.wait_started()
            rows = wait_engine_in_flight(fleet.url, 2, "colocated-0", 4)
            assert rows[0]["requests_in_flight_here"] == rows[1]["requests_in_flight_peers"]
            end = time.monotonic() + 30
            while True:  # the other gateway's series arrive with its next publish (1 s)
                m = metric_samples(fleet.url)
                engine = (("engine", "colocated-0"), ("role", "colocated"))
                live = [m.get(("tandem:peer_gateways_live", (("gateway", g),))) for g in "01"]
                if m[("tandem:router_requests_in_flight", engine)] == 4 and live == [1, 1]:
                    break
                assert time.monotonic() < end, m
                time.sleep(0.25)
            for g in "01":
                assert m[("tandem:peer_load_records_received_total", (("gateway", g),))] > 0
                key = (
                    "tandem:peer_load_dropped_total",
                    (("gateway", g), ("reason", "bad_datagram")),
                )
                assert m[key] == 0
        finally:
            held.close()
        assert held.errors == [], held.errors
        wait_engine_in_flight(fleet.url, 2, "colocated-0", 0)  # every stream aborted
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0.0}
        r = httpx.post(fleet.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
        assert fleet.stop() == 0, fleet.log()
        log = fleet.log()
        assert log.count("tandem: stopped") == 3 and "exited with" not in log, log
        assert "leaving" not in log  # the command stopped the engines it started
        assert "not shared" not in log  # peer_load's channel opened in both gateways
        assert glob.glob(os.path.join(short_tmp, "tandem-gw-*")) == []  # removed at stop
    finally:
        fleet.crash()
        shutil.rmtree(short_tmp, ignore_errors=True)
