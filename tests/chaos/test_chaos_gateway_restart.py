"""Chaos: the gateway process crashes and a new one takes over while the
engines keep running (``--detach-engines``, then ``--attach``;
``cluster/engines/attach.py``).

The test process holds the Ray cluster; each gateway is a ``tandem serve``
process joining it with ``--address``. Gateway 1 starts 1 prefill + 2 decode
engines as detached actors and is SIGKILLed with 2 x 16 long streams in
flight; the clients see their connections break. The engines survive (same
epochs) still holding that work. Gateway 2 adopts them: the old requests are
aborted, every engine idles with 0 blocks held and passes check_integrity();
the clients reconnect and resend, and every stream is token-identical to the
undisturbed run. A detached engine that crashes then is restarted by Ray
with gateway 1's arguments, and gateway 2 joins it again. A third gateway
joining an engine does not take it from gateway 2, which serves on
(several gateways over one fleet). Gateway 2's normal shutdown leaves the
engines running (they were started to outlive a gateway); ``tandem
stop-engines`` ends them, so no actor outlives the test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tandem.cluster.engines.attach import AttachError, adopt_engines, find_engines, stop_engines
from tandem.wire.auth import secret_fingerprint
from tests.chaos.gateway_proc import GatewayProcess, gateway_env
from tests.chaos.harness import ENGINE, WORKLOADS, Tally, Workload, print_row, verdict
from tests.chaos.service import settle_engines, stats
from tests.cluster.service_helpers import BUSY_FIELDS

pytestmark = pytest.mark.slow

# the crashed gateway's streams: too long to finish before it is killed
LONG_TOKENS = 900
NOWHERE = "tcp://127.0.0.1:9"  # an output address no gateway listens on


def engine_flags() -> list[str]:
    return [
        "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
        "--max-num-seqs", str(ENGINE["max_num_seqs"]),
        "--max-model-len", str(ENGINE["max_model_len"]),
        # the dead gateway's requests are dropped when its connection stays
        # down, not by the engines' stall timeout
        "--output-stall-timeout-s", "600",
        "--gateway-lost-after-s", "3",
    ]  # fmt: skip


def wait_health(gateway: GatewayProcess, status: str, reason: str, deadline_s: float = 30.0):
    end = time.monotonic() + deadline_s
    while True:
        body = httpx.get(gateway.url + "/health", timeout=10).json()
        if body["status"] == status and reason in body.get("reason", ""):
            return
        assert time.monotonic() < end, f"/health still {body} after {deadline_s} s"
        time.sleep(0.2)


def wait_adopted(actor, old_epoch: int, session: int, deadline_s: float = 120.0) -> int:
    """Until ``actor`` runs a new incarnation that serves gateway ``session``;
    returns its epoch."""
    import ray

    end = time.monotonic() + deadline_s
    while True:
        try:
            info = ray.get(actor.ready.remote(), timeout=10)
            if info["epoch"] != old_epoch and session in info["gateways"]:
                return info["epoch"]
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass  # restarting
        assert time.monotonic() < end, f"not restarted and adopted within {deadline_s} s"
        time.sleep(0.2)


def epochs(handles) -> dict[str, int]:
    import ray

    return {h.engine_id: ray.get(h.actor.ready.remote(), timeout=60)["epoch"] for h in handles}


def num_busy(handles) -> int:
    return sum(getattr(stats(h).scheduler, k) for h in handles for k in BUSY_FIELDS)


def test_gateway_restart_engines_keep_running_new_gateway_adopts_them(tmp_path, monkeypatch):
    import ray

    # the gateways join this Ray with its token (ray.init enables token auth
    # in os.environ and writes the token where child processes find it); Ray,
    # engine and gateway sockets on loopback. Never flip RAY_AUTH_MODE here:
    # Ray caches the mode per process, and every later ray.init in this
    # pytest process would start a GCS its own driver cannot talk to.
    monkeypatch.setenv("TANDEM_HOST", "127.0.0.1")
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False, _node_ip_address="127.0.0.1")
    address = ray.get_runtime_context().gcs_address
    namespace = f"chaos-gw-{os.getpid()}"
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    common = [
        "--model", "tiny",
        "--address", address,
        "--ray-namespace", namespace,
        "--cluster-secret-file", str(secret),
        "--kv-lease-s", "10",
    ]  # fmt: skip
    env = gateway_env()
    gateways: list[GatewayProcess] = []
    try:
        first = GatewayProcess(
            [*common, "--prefill", "1", "--decode", "2", "--detach-engines", *engine_flags()],
            str(tmp_path / "gateway-1.log"),
            env,
        )
        gateways.append(first)
        first.wait_healthy(300)
        refs = {}
        for workload in WORKLOADS:  # the undisturbed run
            w = Workload(first.url, workload)
            assert not any(w.finish())
            refs[workload] = w.results
        assert first.mapped_torch_libraries() == []  # a serving gateway never loads torch
        handles = find_engines(namespace)
        assert sorted(h.engine_id for h in handles) == ["decode-0", "decode-1", "prefill-0"]
        before = epochs(handles)
        # a gateway that may not adopt them is refused, naming the flag
        fingerprint = secret_fingerprint(secret.read_bytes())
        with pytest.raises(AttachError, match="--model"):
            adopt_engines(namespace, "smollm2", fingerprint)
        with pytest.raises(AttachError, match="--cluster-secret-file"):
            adopt_engines(namespace, "tiny", secret_fingerprint(b"another secret, 16+ bytes"))
        with pytest.raises(AttachError, match="no engine actors"):
            adopt_engines(namespace + "-empty", "tiny", fingerprint)

        old = [Workload(first.url, w, max_tokens=LONG_TOKENS) for w in WORKLOADS]
        for w in old:
            w.wait_tokens(4)
        crash_s = time.monotonic()
        first.crash()
        for w in old:  # every old stream ends with a broken connection, none hangs
            assert not any(w.finish(60))
            for r in w.results:
                assert not r.done and (r.exception or r.error), r
        # the engines live on, the same incarnations; they drop the dead
        # gateway with its requests
        assert epochs(handles) == before
        deadline = time.monotonic() + 60
        while num_busy(handles) > 0:
            assert time.monotonic() < deadline, "the dead gateway's requests still run"
            time.sleep(0.5)
        aborted = sum(stats(h).num_gateway_requests_aborted for h in handles)
        assert aborted > 0

        second = GatewayProcess([*common, "--attach"], str(tmp_path / "gateway-2.log"), env)
        gateways.append(second)
        assert second.wait_healthy(180)["status"] == "ok"
        restart_s = time.monotonic() - crash_s
        assert epochs(handles) == before  # joined, not restarted
        assert settle_engines(handles) == 0  # no orphan of the old gateway

        # a detached engine that crashes under gateway 2 is restarted by Ray
        # with gateway 1's constructor arguments: gateway 2 adopts it again
        by_id = {h.engine_id: h for h in handles}
        session = max(ray.get(by_id["decode-1"].actor.ready.remote(), timeout=60)["gateways"])
        decode0 = by_id["decode-0"].actor
        os.kill(ray.get(decode0.ready.remote(), timeout=60)["pid"], signal.SIGKILL)
        before["decode-0"] = wait_adopted(decode0, before["decode-0"], session)
        wait_health(second, "ok", "")

        tally = Tally("gateway process killed, a new one adopts the engines (--attach)")
        again = [Workload(second.url, w) for w in WORKLOADS]  # the clients reconnect
        for w in again:
            tally.add(w.workload, w.results, refs[w.workload], w.finish())
        tally.leaked_blocks = settle_engines(handles)
        print_row(tally)
        print(
            f"   gateway restart: new gateway healthy {restart_s:.1f} s after the kill; "
            f"{aborted} requests of the old one aborted by the engines",
            flush=True,
        )
        assert tally.identical == tally.requests, tally.details
        assert tally.leaked_blocks == 0

        # another gateway joining an engine does not take it from gateway 2
        joined = ray.get(by_id["decode-1"].actor.join.remote(NOWHERE, time.time_ns()), timeout=60)
        assert session in joined["gateways"] and len(joined["gateways"]) == 2
        w = Workload(second.url, "greedy", num_streams=4)
        assert not any(w.finish())
        assert all(
            verdict(r, ref, False) == "identical" for r, ref in zip(w.results, refs["greedy"])
        )
        wait_health(second, "ok", "")

        # a normal shutdown of the adopting gateway leaves the engines running
        assert second.stop() == 0, second.log()
        assert epochs(handles) == before
    finally:
        for g in gateways:
            g.crash()
        try:
            stop = subprocess.run(
                [sys.executable, "-m", "tandem.cluster", "stop-engines"]
                + ["--address", address, "--ray-namespace", namespace],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
        finally:
            stop_engines(namespace)  # whatever the command left (nothing when it worked)
            left = find_engines(namespace)
            ray.shutdown()
    assert stop.returncode == 0, stop.stdout + stop.stderr
    stopped = re.search(r"stopped (.*) in namespace", stop.stdout).group(1).split(", ")
    assert sorted(stopped) == ["decode-0", "decode-1", "prefill-0"]
    assert left == []  # no detached actor outlives the test
