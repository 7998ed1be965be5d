"""CPU an engine process burns while it has nothing to compute.

Engines run in their own processes (no Ray, no gateway), UCX on TCP only
(so a READ from a stopped prefill engine stays in flight). CPU is read from
/proc/<pid>/stat (utime + stime) over a fixed window, per state:

  idle colocated      no connector, no request
  idle decode         NIXL connector, no request
  P holding blocks    a finished prefill whose blocks wait for D (lease 600 s)
  D waiting for KV    a handoff whose READ cannot finish: P is stopped (SIGSTOP)

Run: python benchmarks/engine_idle_cpu.py [--window-s 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(pid: int, window_s: float) -> float:
    """Percent of one core used by ``pid`` over ``window_s``."""
    start_cpu, start = cpu_s(pid), time.monotonic()
    time.sleep(window_s)
    return 100.0 * (cpu_s(pid) - start_cpu) / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-s", type=float, default=5.0)
    args = parser.parse_args()
    os.environ["UCX_TLS"] = "tcp"  # inherited by the engine processes

    from benchmarks._machine import machine
    from tandem.kvtransfer.handoff import decode_request, prefill_request
    from tandem.wire.engine_protocol import EngineRequest, SamplingParams
    from tandem.workers.config import EngineConfig
    from tests.e2e.engine_proc import Harness

    h = Harness()
    rows = []
    try:
        common = dict(model="tiny", num_kv_blocks=64, max_model_len=256, torch_threads=1)
        kv = dict(kv_connector="nixl", kv_lease_s=600.0, kv_load_timeout_s=600.0)
        h.start("C", EngineConfig.from_flat(role="colocated", **common))
        h.start("P", EngineConfig.from_flat(role="prefill", **common, **kv))
        h.start("D", EngineConfig.from_flat(role="decode", **common, **kv))
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        warm = EngineRequest("warm", list(range(5, 45)), sp)  # handshake D -> P once
        h.send("P", prefill_request(warm))
        h.send("D", decode_request(warm, h.wait_final("warm", "P")))
        h.wait_final("warm", "D")
        h.wait_idle("P")
        h.wait_idle("D")
        pid = {name: ep.proc.pid for name, ep in h.engines.items()}
        rows.append(("idle colocated", measure(pid["C"], args.window_s)))
        rows.append(("idle decode (NIXL)", measure(pid["D"], args.window_s)))
        req = EngineRequest("held", list(range(7, 47)), sp)
        h.send("P", prefill_request(req))
        first = h.wait_final("held", "P")
        rows.append(("P holding blocks for D", measure(pid["P"], args.window_s)))
        os.kill(pid["P"], signal.SIGSTOP)
        try:
            h.send("D", decode_request(req, first))
            deadline = time.monotonic() + 30
            while not h.stats("D").scheduler.num_waiting_for_remote_kvs:
                assert time.monotonic() < deadline, "D never waited for the read"
                time.sleep(0.05)
            rows.append(("D waiting for a remote read", measure(pid["D"], args.window_s)))
        finally:
            os.kill(pid["P"], signal.SIGCONT)
        h.wait_final("held", "D", timeout_s=60)
    finally:
        h.close()
    print(f"\nEngine CPU while idle or waiting, {args.window_s:.0f} s windows, UCX_TLS=tcp")
    print(machine())
    print(f"load average {os.getloadavg()[0]:.1f}\n")
    print(f"{'state':<30}{'CPU (% of one core)':>22}")
    for name, pct in rows:
        print(f"{name:<30}{pct:>22.1f}")


if __name__ == "__main__":
    main()
