"""``benchmarks/gateway_token_path.py --backend engine`` runs: the gateway over the
production backend (``RayBackend``'s data plane and orchestrator, no Ray) streams every
token of a synthetic engine process (``benchmarks/_synthetic_engine.py``) and prints its
table; the engine process is stopped after. A run that lost outputs would never finish
its streams: the subprocess's deadline fails it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_engine_backend_run_streams_every_token_and_prints_its_table():
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "gateway_token_path.py"),
        "--backend", "engine", "--engine-step-ms", "0", "--repeats", "1",
        "--streams", "8", "--tokens", "64", "--rounds", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(  # its own process group: its engine's too
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, stderr[-3000:]
    assert "RayBackend over a synthetic engine (0 ms steps)" in stdout
    rows = [line for line in stdout.splitlines() if line.startswith("| gateway |")]
    assert len(rows) == 1 and float(rows[0].split("|")[2]) > 0
    leftover = subprocess.run(
        ["pgrep", "-g", str(proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert not leftover, f"processes of the run left: {leftover}"


def test_the_cachegrind_child_streams_every_token_of_each_app():
    """``benchmarks/gateway_instructions.py``'s child (what runs under cachegrind; here
    without it) drives each app through this harness and counts its body events: a child
    that streamed nothing (session 18's: the harness's coroutines never awaited) would count
    nothing, and its cachegrind totals would be start-up only."""
    at_least = 2 * 4 * 8  # the warm-up and one round, 4 streams of 8 tokens
    for kind in ("gateway", "bare"):
        done = subprocess.run(
            [sys.executable, os.path.join(ROOT, "benchmarks", "gateway_instructions.py"),
             "--child", kind, "1", "4", "8"],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        sent = int(done.stdout.split(f"{kind} sent ")[1].split()[0])
        assert sent >= at_least, done.stdout
