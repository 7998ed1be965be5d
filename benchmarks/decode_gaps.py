"""Engine-level interference: decode token gaps while long prompts arrive,
prefilled on a separate prefill engine (handed off over real NIXL) versus on
the decode engine itself. Engines run in their own processes joined over
ZMQ (no gateway, no Ray), which separates the engines' own interference
from the serving stack's in benchmarks/serve_interference.py.

Run: python benchmarks/decode_gaps.py
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


LONG_PROMPTS_PER_S = 2.0


def measure(disaggregated: bool, ckpt: str) -> tuple[list[float], int]:
    """Token gaps (ms) of 4 decode streams while 1536-token prompts arrive
    (LONG_PROMPTS_PER_S): prefilled on P and handed to D, or prefilled on D itself."""
    from tandem.kvtransfer.handoff import decode_request, prefill_request
    from tandem.wire.engine_protocol import EngineRequest, SamplingParams
    from tandem.workers.config import EngineConfig
    from tests.e2e.engine_proc import Harness

    h = Harness()
    try:
        common = dict(model=ckpt, num_kv_blocks=512, max_model_len=2048, torch_threads=1)
        if disaggregated:
            h.start("P", EngineConfig.from_flat(role="prefill", kv_connector="nixl", **common))
            h.start("D", EngineConfig.from_flat(role="decode", kv_connector="nixl", **common))
        else:
            h.start("D", EngineConfig.from_flat(role="colocated", **common))
        rng = random.Random(0)
        sp = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        for i in range(4):
            h.send("D", EngineRequest(f"d{i}", [rng.randrange(262) for _ in range(32)], sp))
        arrivals: dict[str, list[float]] = {f"d{i}": [] for i in range(4)}
        pending: dict[str, EngineRequest] = {}
        end = time.monotonic() + 10
        next_long, n = time.monotonic() + 0.5, 0
        while time.monotonic() < end:
            if time.monotonic() >= next_long:
                rid = f"L{n}"
                n += 1
                prompt = [rng.randrange(262) for _ in range(1536)]
                if disaggregated:
                    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
                    h.send("P", prefill_request(req))
                    pending[rid] = req
                else:
                    h.send(
                        "D",
                        EngineRequest(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True)),
                    )
                next_long += 1.0 / LONG_PROMPTS_PER_S
            h._pump(1)
            for rid in list(pending):
                for eid, o in h.outputs.get(rid, []):
                    if eid == "P" and o.finish_reason is not None:
                        h.send("D", decode_request(pending.pop(rid), o))
            now = time.monotonic()
            for rid, ts in arrivals.items():
                ts.extend([now] * (len(h.outputs.get(rid, [])) - len(ts)))
        gaps = sorted((b - a) * 1000 for ts in arrivals.values() for a, b in zip(ts, ts[1:]))
    finally:
        h.close()
    return gaps, n


def main() -> None:
    from benchmarks._machine import machine
    from benchmarks.serve_interference import MODEL, make_checkpoint

    ckpt = make_checkpoint(tempfile.mkdtemp(prefix="tandem-gaps-"))
    rows = [("1 prefill + 1 decode", *measure(True, ckpt)), ("1 colocated", *measure(False, ckpt))]
    print(f"machine: {machine()}")
    print(
        f"workload: random Llama {MODEL}, fp32; 4 decode streams, 1536-token prompts at "
        f"{LONG_PROMPTS_PER_S:g}/s "
        "(prefilled on P and handed off, or prefilled on the decode engine); "
        "1 torch thread per engine; 10 s; engines over ZMQ, no gateway, no Ray"
    )
    print("| setup | long prompts | gaps | median ms | p99 ms | max ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, gaps, n in rows:
        p99 = gaps[int(0.99 * (len(gaps) - 1))]
        print(
            f"| {name} | {n} | {len(gaps)} | {statistics.median(gaps):.1f} | {p99:.1f} "
            f"| {gaps[-1]:.1f} |"
        )
    r = [g[int(0.99 * (len(g) - 1))] for _, g, _ in rows]
    print(f"disaggregated / colocated decode gap p99: {r[0] / r[1]:.2f}")


if __name__ == "__main__":
    main()
