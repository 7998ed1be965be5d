"""Start-up probe: which transport UCX uses for a KV READ on this host.

NIXL cannot say which UCX transport carries a transfer, and the engine's
own UCX cannot print its choice without flooding its stdout. So at start-up
the connector (``TransportProbe``) runs one READ of 1 MiB between two fresh
processes of this host, with the engine's environment (the settings of
``env.py`` included) and the KV cache's memory type, the reader with
``UCX_PROTO_INFO=y``; its tables say what UCX picked (``proto_info.py``)::

    engine ──(thread)── python -m tandem.kvtransfer.ucx.probe         UCX_PROTO_INFO=y
                           └── python -m tandem.kvtransfer.ucx.probe --serve
                               registers 1 MiB (DRAM / VRAM of the same GPU),
                               prints its agent metadata, progresses until
                               its stdin closes
                           READ it, check the bytes, print the result line

What it shows is the intra-node path (P and D on one host); between hosts
the same settings let UCX pick RDMA, which only real traffic exercises.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from tandem.kvtransfer.ucx.proto_info import TransportReport, parse_proto_info, transport_report

logger = logging.getLogger(__name__)

PROBE_BYTES = 1 << 20
RESULT_TAG = "TANDEM_UCX_PROBE"
TARGET_TAG = "TANDEM_UCX_TARGET"


def _buffer(memory: str, device_id: int, fill: int) -> tuple[Any, int]:
    if memory == "VRAM":
        import torch

        t = torch.full((PROBE_BYTES,), fill, dtype=torch.uint8, device=f"cuda:{device_id}")
        return t, t.data_ptr()
    import numpy as np

    a = np.full(PROBE_BYTES, fill, dtype=np.uint8)
    return a, a.ctypes.data


def _agent(name: str, memory: str, addr: int, device_id: int) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory([(addr, PROBE_BYTES, device_id, "")], memory)
    return agent


def _descs(agent: Any, addr: int, device_id: int, memory: str) -> Any:
    import numpy as np

    return agent.get_xfer_descs(np.array([[addr, PROBE_BYTES, device_id]], dtype=np.uint64), memory)


def serve(memory: str, device_id: int) -> None:
    """The target: hold a registered buffer until stdin closes."""
    buf, addr = _buffer(memory, device_id, fill=7)
    agent = _agent(f"tandem-probe-target-{os.getpid()}", memory, addr, device_id)
    info = {"metadata": agent.get_agent_metadata().hex(), "addr": addr}
    print(TARGET_TAG + json.dumps(info), flush=True)
    while not select.select([sys.stdin], [], [], 0.001)[0]:
        agent.get_new_notifs()  # two-sided transports need the target to progress
    del buf


def _target_info(target: subprocess.Popen, timeout_s: float) -> dict[str, Any] | None:
    """The target's tagged line (other lines are NIXL's own logging); reads
    the pipe unbuffered so that ``select`` sees every byte."""
    assert target.stdout is not None
    fd = target.stdout.fileno()
    data = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in data.split(b"\n")[:-1]:
            if line.startswith(TARGET_TAG.encode()):
                return json.loads(line[len(TARGET_TAG) :])
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break  # the target exited
        data += chunk
    return None


def initiate(memory: str, device_id: int, timeout_s: float) -> dict[str, Any]:
    """The reader: start the target, READ its buffer, compare the bytes."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_PROTO_INFO"}
    target = subprocess.Popen(
        [sys.executable, "-m", "tandem.kvtransfer.ucx.probe", "--serve", "--memory", memory]
        + ["--device-id", str(device_id)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    name = f"tandem-probe-reader-{os.getpid()}"
    result: dict[str, Any] = {"worker": name, "state": "NONE", "bytes_ok": False}
    try:
        info = _target_info(target, timeout_s)
        if info is None:
            result["state"] = "TARGET_TIMEOUT"
            return result
        buf, addr = _buffer(memory, device_id, fill=0)
        agent = _agent(name, memory, addr, device_id)
        peer = agent.add_remote_agent(bytes.fromhex(info["metadata"]))
        handle = agent.initialize_xfer(
            "READ",
            _descs(agent, addr, device_id, memory),
            _descs(agent, info["addr"], device_id, memory),
            peer,
        )
        state = agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
        result["state"] = state
        if state == "DONE":
            data = buf.cpu().numpy() if memory == "VRAM" else buf
            result["bytes_ok"] = bool((data == 7).all())
        agent.release_xfer_handle(handle)
        return result
    finally:
        if target.stdin is not None:
            target.stdin.close()
        try:
            target.wait(10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait(5)


def run_probe(memory: str, device_id: int = 0, timeout_s: float = 60.0) -> TransportReport:
    """Run the probe processes and report what UCX picked (blocking)."""
    env = dict(os.environ, UCX_PROTO_INFO="y")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tandem.kvtransfer.ucx.probe", "--memory", memory]
            + ["--device-id", str(device_id), "--timeout-s", str(timeout_s)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s * 2 + 30,
        )
        stdout, failure = proc.stdout, "" if proc.returncode == 0 else proc.stderr[-500:]
    except subprocess.TimeoutExpired:
        stdout, failure = "", f"the probe did not finish in {timeout_s * 2 + 30:.0f} s"
    result: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
    if result.get("state") != "DONE" or not result.get("bytes_ok"):
        failure = failure or f"the probe READ ended {result.get('state', 'NONE')}"
        return TransportReport(memory, "", "unknown", "", False, False, f"probe failed: {failure}")
    return transport_report(parse_proto_info(stdout), memory, worker=result["worker"])


class TransportProbe:
    """Runs ``run_probe`` on a daemon thread; ``report()`` is None until done.
    Logs the result (a warning for the slow VRAM fallback)."""

    def __init__(self, memory: str, device_id: int, engine_id: str) -> None:
        self._report: TransportReport | None = None
        self._thread = threading.Thread(
            target=self._run, args=(memory, device_id, engine_id), name="ucx-probe", daemon=True
        )
        self._thread.start()

    def _run(self, memory: str, device_id: int, engine_id: str) -> None:
        report = run_probe(memory, device_id)
        text = (
            f"KV transport of engine {engine_id} ({memory}, {report.scope or 'probe'}): "
            f"{report.transport} ({report.path or 'no path'})"
        )
        if report.warning:
            logger.warning("%s: %s", text, report.warning)
        else:
            logger.info("%s", text)
        self._report = report

    def report(self) -> TransportReport | None:
        return self._report

    def wait(self, timeout_s: float) -> TransportReport | None:
        self._thread.join(timeout_s)
        return self._report


def main() -> None:
    parser = argparse.ArgumentParser(description="UCX transport probe (see module doc)")
    parser.add_argument("--memory", choices=["DRAM", "VRAM"], required=True)
    parser.add_argument("--device-id", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--serve", action="store_true", help="be the target")
    args = parser.parse_args()
    logging.getLogger("nixl").setLevel(logging.WARNING)
    if args.serve:
        serve(args.memory, args.device_id)
        return
    result = initiate(args.memory, args.device_id, args.timeout_s)
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
