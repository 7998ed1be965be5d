"""`ray start --head` + `ray job submit -- python -m tandem.cluster serve` on loopback:
the job's Python has Tandem installed (as every node's must), and the service comes up
and answers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tandem.cluster.engines.actor import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def run(*args, env, timeout=120, check=True):
    """Run the `ray` CLI; a failure names the command and shows what it printed."""
    proc = subprocess.run(
        [os.path.join(BIN, "ray"), *args],
        env=env,
        cwd=ROOT,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    if check:
        expect_ok(args, proc)
    return proc


def expect_ok(args, proc) -> None:
    if proc.returncode != 0:
        raise AssertionError(
            f"ray {' '.join(args)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        )


def submit_when_agent_ready(*args, env, deadline_s=120.0):
    """``ray job submit``, again while the head's job agent is not up yet: on
    a loaded machine the dashboard answers before its agent registers, and
    the submit fails with 'No available agent to submit job'."""
    deadline = time.monotonic() + deadline_s
    while True:
        proc = run(*args, env=env, check=False)
        if proc.returncode == 0 or "No available agent" not in proc.stderr:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(2)
    expect_ok(args, proc)
    return proc


def cluster_pids(temp_dir: str) -> list[int]:
    """Processes of the Ray cluster started with ``--temp-dir=temp_dir``: each
    one (GCS, raylet, agents, workers) names its session under it."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if temp_dir.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue  # exited meanwhile
    return pids


def stop_cluster(temp_dir: str, grace_s: float = 15.0) -> None:
    """Stop this test's Ray cluster only (``ray stop`` would stop every Ray
    on the machine, other people's included): SIGTERM, then SIGKILL what is
    left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in cluster_pids(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while cluster_pids(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert not cluster_pids(temp_dir), "Ray processes of the test's cluster outlived SIGKILL"


# what ``ray start`` prints when its raylet or GCS did not answer in time: on a loaded
# two-core machine (the suite's other worker starting engines) it happens now and then
_STARTUP_TIMED_OUT = ("timed out during startup", "Deadline Exceeded")


def start_head(tmp: str, gcs: int, dash: int, env: dict, attempts: int = 2) -> None:
    """``ray start --head`` with this test's ports and temp dir; once more, after stopping
    what the first try left, when the first timed out during startup (any other failure
    fails at once)."""
    for attempt in range(attempts):
        proc = run(
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=2",
            f"--temp-dir={tmp}",
            "--include-dashboard=true",
            # the agents' fixed default ports (52365, ...) may still be held
            # by a Ray an earlier test stopped: then the job agent never
            # registers ('No available agent to submit job')
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            env=env,
            check=False,
        )
        if proc.returncode == 0:
            return
        timed_out = any(text in proc.stderr for text in _STARTUP_TIMED_OUT)
        if not timed_out or attempt == attempts - 1:
            expect_ok(("start", "--head"), proc)
        stop_cluster(tmp)  # what the try started, before the next


def test_ray_job_submit_serves_completions():
    tmp = tempfile.mkdtemp(prefix="tandem-ray-")
    gcs, dash, api = free_port(), free_port(), free_port()
    # the job's `python` is looked up on PATH: the one running these tests
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=BIN + os.pathsep + os.environ["PATH"])
    env.pop("RAY_ADDRESS", None)
    job_id = None
    dash_url = f"http://127.0.0.1:{dash}"
    try:
        start_head(tmp, gcs, dash, env)
        out = submit_when_agent_ready(
            "job",
            "submit",
            f"--address={dash_url}",
            "--no-wait",
            "--",
            "python",
            "-m",
            "tandem.cluster",
            "serve",
            "--model",
            "tiny",
            "--port",
            str(api),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--num-kv-blocks",
            "128",
            "--max-model-len",
            "512",
            env=env,
        )
        job_id = next(w for w in out.stdout.split() if w.startswith("raysubmit_"))
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                logs = run("job", "logs", f"--address={dash_url}", job_id, env=env, check=False)
                pytest.fail(f"service did not become healthy; job logs:\n{logs.stdout[-4000:]}")
            time.sleep(1)
        r = httpx.post(
            f"http://127.0.0.1:{api}/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        if job_id:
            run("job", "stop", f"--address={dash_url}", job_id, env=env, check=False)
        stop_cluster(tmp)  # also what a failed start left
        shutil.rmtree(tmp, ignore_errors=True)
