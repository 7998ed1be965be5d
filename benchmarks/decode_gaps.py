"""Decode engine alone under handoffs: token gaps on D while long prompts
arrive through P (no gateway, no Ray; engines in their own processes joined
over ZMQ, real NIXL between them). Separates the engine's own interference
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


def main() -> None:
    from benchmarks._machine import machine
    from benchmarks.serve_interference import MODEL, make_checkpoint
    from scheduler.messages import EngineRequest, SamplingParams
    from tests.e2e.engine_proc import Harness
    from workers.config import EngineConfig

    ckpt = make_checkpoint(tempfile.mkdtemp(prefix="tandem-gaps-"))
    h = Harness()
    try:
        common = dict(
            model=ckpt, kv_connector="nixl", num_kv_blocks=512, max_model_len=2048, torch_threads=1
        )
        h.start("P", EngineConfig(role="prefill", **common))
        h.start("D", EngineConfig(role="decode", **common))
        rng = random.Random(0)
        sp = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        for i in range(4):
            h.send("D", EngineRequest(f"d{i}", [rng.randrange(262) for _ in range(32)], sp))
        arrivals: dict[str, list[float]] = {f"d{i}": [] for i in range(4)}
        pending: set[str] = set()
        end = time.monotonic() + 10
        next_long, n = time.monotonic() + 0.5, 0
        while time.monotonic() < end:
            if time.monotonic() >= next_long:
                rid = f"L{n}"
                n += 1
                h.send(
                    "P",
                    EngineRequest(
                        rid,
                        [rng.randrange(262) for _ in range(1536)],
                        SamplingParams(max_tokens=1),
                        kv_transfer_params={"do_remote_decode": True},
                    ),
                )
                pending.add(rid)
                next_long += 1.0
            h._pump(1)
            for rid in list(pending):
                for eid, o in h.outputs.get(rid, []):
                    if eid == "P" and o.finish_reason is not None:
                        params = dict(o.kv_transfer_params, do_remote_prefill=True)
                        h.send(
                            "D",
                            EngineRequest(
                                rid,
                                [0] * 1536 + o.new_token_ids,
                                SamplingParams(max_tokens=1),
                                kv_transfer_params=params,
                            ),
                        )
                        pending.discard(rid)
            now = time.monotonic()
            for rid, ts in arrivals.items():
                ts.extend([now] * (len(h.outputs.get(rid, [])) - len(ts)))
        gaps = sorted((b - a) * 1000 for ts in arrivals.values() for a, b in zip(ts, ts[1:]))
    finally:
        h.close()
    print(f"machine: {machine()}")
    print(
        f"workload: random Llama {MODEL}, fp32; 4 decode streams on D, {n} handoffs of "
        "1536-token prompts (1/s) through P; 1 torch thread per engine; 10 s"
    )
    print("| gaps | median ms | p99 ms | max ms |")
    print("|---:|---:|---:|---:|")
    p99 = gaps[int(0.99 * (len(gaps) - 1))]
    print(f"| {len(gaps)} | {statistics.median(gaps):.1f} | {p99:.1f} | {gaps[-1]:.1f} |")


if __name__ == "__main__":
    main()
