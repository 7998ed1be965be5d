"""How many NIXL descriptors a decode engine's KV READs post once the block
pools churn: the connector posts one per run of blocks consecutive on both
engines, so what decides "fewer, larger descriptors" in service is how
scattered the two allocators leave a request's blocks.

Run from the repository root::

    .venv/bin/python benchmarks/kv_fragmentation.py

A prefill and a decode EngineCore in their own processes (the tiny test
Llama, ZMQ + real NIXL, no Ray; ``tests/e2e/engine_proc.py``) hand off
``--requests`` random prompts (3-10 blocks) in waves of ``--concurrency``;
decode lengths are random, so D's requests end, and free their blocks, out of
order. From each request's timings on D: blocks read and descriptors posted.
The first wave meets fresh pools; later ones meet the churn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BLOCK = 16


def run(requests: int, concurrency: int, num_kv_blocks: int, seed: int) -> list[list[tuple]]:
    """Per wave, ``(blocks read, descriptors)`` of each request's READ."""
    import numpy as np

    from tandem.kvtransfer.handoff import decode_request, prefill_request
    from tandem.wire.engine_protocol import EngineRequest, SamplingParams
    from tandem.workers.config import EngineConfig
    from tests.e2e.engine_proc import Harness
    from tests.workers.hf_checkpoints import make_checkpoint

    rng = np.random.default_rng(seed)
    waves: list[list[tuple]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-kv-frag-") as tmp:
        ckpt = make_checkpoint("llama", tmp)
        common = dict(
            model=ckpt,
            kv_connector="nixl",
            block_size=BLOCK,
            max_num_batched_tokens=256,
            num_kv_blocks=num_kv_blocks,
            max_model_len=512,
        )
        h = Harness()
        try:
            h.start_all(
                {
                    "P": EngineConfig.from_flat(role="prefill", **common),
                    "D": EngineConfig.from_flat(role="decode", **common),
                }
            )
            for start in range(0, requests, concurrency):
                ids = [f"r{i}" for i in range(start, min(start + concurrency, requests))]
                reqs = {}
                for rid in ids:
                    prompt = rng.integers(
                        3, 290, int(rng.integers(3 * BLOCK + 1, 10 * BLOCK))
                    ).tolist()
                    sp = SamplingParams(
                        max_tokens=int(rng.integers(2, 40)), temperature=0.0, ignore_eos=True
                    )
                    reqs[rid] = EngineRequest(rid, prompt, sp)
                    h.send("P", prefill_request(reqs[rid]))
                firsts = {rid: h.wait_final(rid, "P", 120.0) for rid in ids}
                for rid in ids:
                    h.send("D", decode_request(reqs[rid], firsts[rid]))
                wave = []
                for rid in ids:
                    t = h.wait_final(rid, "D", 120.0).timings
                    if t is not None and t.num_kv_blocks:
                        wave.append((t.num_kv_blocks, t.num_kv_descriptors))
                waves.append(wave)
            h.wait_idle("D")
            h.wait_idle("P")
        finally:
            h.close()
    return waves


def summary(reads: list[tuple]) -> str:
    if not reads:
        return "no READs"
    descs = [d for _, d in reads]
    blocks = [b for b, _ in reads]
    one = sum(d == 1 for d in descs) / len(descs)
    return (
        f"{len(reads):>5} {statistics.mean(blocks):>7.1f} {statistics.mean(descs):>7.2f} "
        f"{statistics.median(descs):>5.0f} {max(descs):>4} {one:>8.0%} "
        f"{sum(descs) / sum(blocks):>13.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=96, help="per engine")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    waves = run(args.requests, args.concurrency, args.num_kv_blocks, args.seed)

    from benchmarks._machine import machine

    print(
        f"KV READs of a decode engine, {args.requests} requests in waves of "
        f"{args.concurrency}, {args.num_kv_blocks} blocks of {BLOCK} tokens per engine; "
        f"{machine()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'READs':>20} {'n':>5} {'blocks':>7} {'descs':>7} {'p50':>5} {'max':>4} "
        f"{'1 desc':>8} {'descs/block':>13}"
    )
    print(f"{'first wave (fresh)':>20} {summary(waves[0])}")
    print(f"{'later waves':>20} {summary([r for w in waves[1:] for r in w])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
