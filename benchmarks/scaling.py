"""Elastic pools under load: how long a resize takes, and what clients see.

A real service (local Ray, the `tiny` model, 1 prefill + 1 decode engine at
start) runs STREAMS concurrent seeded streams; once each has a few tokens,
the prefill pool and then the decode pool are resized (POST
/admin/pools/POOL, cluster/disagg/scaling.py): 1 -> 2 in the first half of a
round, 2 -> 1 in the second (the removed decode engine's streams migrate).
Per resize: the call's duration (scale out: the actor placed, the model
loaded, the engine registered and ready; scale in: drain, the streams moved,
the actor stopped). Per workload: whether every stream equals the undisturbed
run (asserted), and the longest silence a client saw between two tokens
while the resizes ran, next to the undisturbed run's p99 gap.

Run:  python benchmarks/scaling.py [--streams 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from tandem.cluster.cli.serve import ServiceThread  # noqa: E402
from tandem.cluster.cli.settings import serve_config  # noqa: E402
from tests.chaos.harness import Workload, verdict  # noqa: E402
from tests.chaos.service import reset_prefix_caches, settle  # noqa: E402

ENGINE = {"num_kv_blocks": 1024, "max_num_seqs": 32, "max_model_len": 1024}
MAX_TOKENS = 256


def scale(svc, pool: str, engines: int) -> tuple[float, dict]:
    start = time.monotonic()
    r = httpx.post(
        f"{svc.base_url}/admin/pools/{pool}",
        json={"engines": engines},
        headers={"Authorization": "Bearer bench"},
        timeout=600,
    )
    r.raise_for_status()
    body = r.json()
    assert not body["failed"] and body["engines"] == engines, body
    return time.monotonic() - start, body


def gaps_ms(results) -> list[float]:
    return [
        (b - a) * 1000
        for r in results
        for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False)
    ]


def main() -> int:
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=8, help="concurrent streams")
    p.add_argument("--rounds", type=int, default=2, help="out-and-in rounds")
    args = p.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    times: dict[tuple[str, str], list[float]] = {}
    migrated, identical, total, worst_gap = 0, 0, 0, 0.0
    loads = []
    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        prefill=1,
        decode=1,
        prefill_max_engines=2,
        decode_max_engines=2,
        admin_api_key="bench",
        ray_namespace=f"bench-scaling-{os.getpid()}",
        **ENGINE,
    )
    try:
        with ServiceThread(config) as svc:
            ref = Workload(svc.base_url, "seeded", args.streams, max_tokens=MAX_TOKENS)
            assert not any(ref.finish())
            steady = sorted(gaps_ms(ref.results))
            steady_p99 = steady[round(0.99 * (len(steady) - 1))]
            for round_ in range(args.rounds):
                for target, action in ((2, "scale_out"), (1, "scale_in")):
                    reset_prefix_caches(svc)
                    w = Workload(svc.base_url, "seeded", args.streams, max_tokens=MAX_TOKENS)
                    w.wait_tokens(4)
                    loads.append(os.getloadavg()[0])
                    for pool in ("prefill", "decode"):
                        seconds, body = scale(svc, pool, target)
                        times.setdefault((action, pool), []).append(seconds)
                        migrated += sum(s["migrated"] for s in body["stopped"])
                        print(f"round {round_}: {pool} -> {target} in {seconds:.2f} s", flush=True)
                    hung = w.finish()
                    verdicts = [
                        verdict(r, x, h)
                        for r, x, h in zip(w.results, ref.results, hung, strict=True)
                    ]
                    assert set(verdicts) == {"identical"}, verdicts
                    identical += verdicts.count("identical")
                    total += len(verdicts)
                    worst_gap = max(worst_gap, max(gaps_ms(w.results)))
            assert settle(svc) == 0
    finally:
        ray.shutdown()
    print(f"\nmachine: {machine()}; {args.streams} seeded streams of {MAX_TOKENS} tokens, "
          f"{args.rounds} rounds; load avg at each resize: "
          + " ".join(f"{x:.1f}" for x in loads))  # fmt: skip
    print("| resize | pool | seconds p50 | seconds max |")
    print("|---|---|---|---|")
    for (action, pool), ts in sorted(times.items(), reverse=True):
        print(
            f"| {action} {'1 -> 2' if action == 'scale_out' else '2 -> 1'} | {pool} | {statistics.median(ts):.2f} | {max(ts):.2f} |"
        )
    print(
        f"\nstreams identical to the undisturbed run: {identical}/{total}; migrated by "
        f"scale-in: {migrated}; longest client gap between tokens while resizing: "
        f"{worst_gap:.0f} ms (undisturbed p99 gap {steady_p99:.0f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
