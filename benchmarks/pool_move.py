"""Pool moves under load: how long a move takes, against the simulator's switch_s.

A real service (local Ray, the `tiny` model, 1 prefill + 2 decode engines, pools
alike so engines may move) runs STREAMS concurrent seeded streams; once each has
a few tokens, the decode engine holding the most streams moves to the prefill pool (POST
/admin/pools/move, cluster/disagg/pool_move.py), and in the next half-round a
prefill engine moves back, streams running again. Per move, the phases the
gateway times: drain (no new work; its decode streams migrate; a prefill
engine's handoffs finish), switch (the engine's set_role), register (the
prefill registry exchange of its new pool, until ready), and the whole call.
The simulator and benchmarks/planner.py model a move as switch_s = 0.72 s
(a measured drain plus one health probe interval): the table sets the
measurement beside it. Per workload: every stream equal to the undisturbed run
(asserted) and the longest silence a client saw between two tokens.

Run:  python benchmarks/pool_move.py [--streams 8] [--rounds 3]
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
from benchmarks.scaling import gaps_ms  # noqa: E402
from tandem.cluster.cli.serve import ServiceThread  # noqa: E402
from tandem.cluster.cli.settings import serve_config  # noqa: E402
from tests.chaos.harness import Workload, verdict  # noqa: E402
from tests.chaos.service import reset_prefix_caches, settle  # noqa: E402

ENGINE = {"num_kv_blocks": 1024, "max_num_seqs": 32, "max_model_len": 1024}
MAX_TOKENS = 256
SIMULATOR_SWITCH_S = 0.72  # benchmarks/planner.py's --switch-s default
PHASES = ("drain_s", "switch_s", "register_s", "total_s")


def busiest(svc, pool: str) -> str:
    """The engine of ``pool`` holding the most streams: the move with the most to migrate."""

    async def held() -> dict[str, int]:
        engines = svc.service.backend.engines.values()
        return {e.state.engine_id: len(e.requests) for e in engines if e.state.role == pool}

    counts = svc.run(held())
    return max(sorted(counts), key=counts.get)


def move(svc, source_pool: str, dest_pool: str) -> tuple[float, dict]:
    engine_id = busiest(svc, source_pool) if source_pool == "decode" else None
    start = time.monotonic()
    r = httpx.post(
        f"{svc.base_url}/admin/pools/move",
        json={"source_pool": source_pool, "dest_pool": dest_pool, "engine_id": engine_id},
        headers={"Authorization": "Bearer bench"},
        timeout=600,
    )
    r.raise_for_status()
    body = r.json()
    assert body["moved"], body
    return time.monotonic() - start, body


def main() -> int:
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=8, help="concurrent streams")
    p.add_argument("--rounds", type=int, default=3, help="there-and-back rounds")
    args = p.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    rows: dict[str, list[dict]] = {}
    identical, total, worst_gap, loads = 0, 0, 0.0, []
    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        prefill=1,
        decode=2,
        prefill_max_engines=2,
        decode_max_engines=2,
        admin_api_key="bench",
        ray_namespace=f"bench-pool-move-{os.getpid()}",
        **ENGINE,
    )
    try:
        with ServiceThread(config) as svc:
            ref = Workload(svc.base_url, "seeded", args.streams, max_tokens=MAX_TOKENS)
            assert not any(ref.finish())
            steady = sorted(gaps_ms(ref.results))
            steady_p99 = steady[round(0.99 * (len(steady) - 1))]
            for round_ in range(args.rounds):
                for source, dest in (("decode", "prefill"), ("prefill", "decode")):
                    reset_prefix_caches(svc)
                    w = Workload(svc.base_url, "seeded", args.streams, max_tokens=MAX_TOKENS)
                    w.wait_tokens(4)
                    loads.append(os.getloadavg()[0])
                    seconds, body = move(svc, source, dest)
                    rows.setdefault(f"{source} -> {dest}", []).append({**body, "call_s": seconds})
                    print(f"round {round_}: {body['engine_id']} {source} -> {dest} in "
                          f"{seconds:.3f} s, {body['migrated']} streams migrated", flush=True)  # fmt: skip
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
    print(f"\nmachine: {machine()}; {args.streams} seeded streams of {MAX_TOKENS} tokens "
          f"running at each move, {args.rounds} rounds; load avg at each move: "
          + " ".join(f"{x:.1f}" for x in loads))  # fmt: skip
    print("| move | migrated (mean) | drain s p50 | switch s p50 | register s p50 | "
          "total s p50 | total s max | simulator switch_s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label, moves in rows.items():
        p50 = {k: statistics.median(m[k] for m in moves) for k in PHASES}
        print(
            f"| {label} | {statistics.mean(m['migrated'] for m in moves):.1f} | "
            f"{p50['drain_s']:.3f} | {p50['switch_s']:.3f} | {p50['register_s']:.3f} | "
            f"{p50['total_s']:.3f} | {max(m['total_s'] for m in moves):.3f} | "
            f"{SIMULATOR_SWITCH_S} |"
        )
    print(
        f"\nstreams identical to the undisturbed run: {identical}/{total}; longest client "
        f"gap between tokens while moving: {worst_gap:.0f} ms (undisturbed p99 gap "
        f"{steady_p99:.0f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
