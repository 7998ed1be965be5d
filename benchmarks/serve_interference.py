"""Interference: decode ITL while long prompts arrive, 1P+1D vs 2 colocated.

Both setups run the built-in `tiny` model on the same cores (2 engines, one
torch thread each) under the same load, driven by `tandem bench`'s engine
(cluster.bench.run_benchmark):

  steady decodes : 4 concurrent streams, 32-token prompts, 256 output tokens
  long prompts   : Poisson 2.5/s, 1800-token prompts, 2 output tokens

Reported: ITL and TPOT of the steady decodes, TTFT of the long prompts.
Target: disaggregated decode ITL p99 at most half the colocated one.

Run: python benchmarks/serve_interference.py
"""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from cluster.bench import BenchConfig, run_benchmark  # noqa: E402
from cluster.serve import SERVE_DEFAULTS, ServiceThread  # noqa: E402

ENGINE = {
    "num_kv_blocks": 512,
    "max_num_seqs": 64,
    "max_model_len": 2048,
    "max_num_batched_tokens": 2048,
}
SETUPS = {
    "1 prefill + 1 decode": dict(prefill=1, decode=1, colocated=0),
    "2 colocated": dict(prefill=0, decode=0, colocated=2),
}


async def _load(url: str, seed: int) -> tuple[dict, dict]:
    decodes = BenchConfig(
        url=url, num_requests=12, concurrency=4, input_len=32, output_len=256, seed=seed
    )
    longs = BenchConfig(
        url=url, num_requests=24, request_rate=2.5, input_len=1800, output_len=2, seed=seed + 1
    )
    return tuple(await asyncio.gather(run_benchmark(decodes), run_benchmark(longs)))


def run_setup(pools: dict) -> tuple[dict, dict]:
    settings = dict(SERVE_DEFAULTS, ray_dashboard=False, **pools)
    per_role = {r: dict(ENGINE) for r in ("prefill", "decode", "colocated")}
    with ServiceThread(settings, per_role) as svc:
        asyncio.run(_load(svc.base_url, seed=100))  # warm-up (handshakes, caches)
        return asyncio.run(_load(svc.base_url, seed=0))


def main() -> None:
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for name, pools in SETUPS.items():
            d, lg = run_setup(pools)
            assert d["num_failed"] == 0 and lg["num_failed"] == 0, (d["errors"], lg["errors"])
            rows.append((name, d, lg))
    finally:
        ray.shutdown()
    print(f"machine: {machine()}")
    print(
        "workload: tiny; 4 steady decode streams (32 in / 256 out) + long prompts "
        "(1800 in / 2 out, Poisson 2.5/s); 2 engines, 1 torch thread each"
    )
    hdr = (
        "| setup | decode ITL p50 ms | decode ITL p99 ms | decode TPOT mean ms "
        "| long-prompt TTFT p50 ms | long-prompt TTFT p99 ms | decode tok/s |"
    )
    print(hdr)
    print("|" + "|".join("---" for _ in hdr.split("|")[1:-1]) + "|")
    for name, d, lg in rows:
        print(
            f"| {name} | {d['itl_ms']['p50']:.1f} | {d['itl_ms']['p99']:.1f} "
            f"| {d['tpot_ms']['mean']:.1f} | {lg['ttft_ms']['p50']:.0f} "
            f"| {lg['ttft_ms']['p99']:.0f} | {d['output_token_throughput']:.0f} |"
        )
    ratio = rows[0][1]["itl_ms"]["p99"] / rows[1][1]["itl_ms"]["p99"]
    print(f"disaggregated / colocated decode ITL p99: {ratio:.2f} (target <= 0.5)")


if __name__ == "__main__":
    main()
