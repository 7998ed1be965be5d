"""The sla planner against every fixed split of four engine slots, simulated.

A trace whose mix shifts half-way: phase A, short prompts and long answers
(decode-heavy); phase B, long prompts and short answers (prefill-heavy).
Each configuration replays it through the simulator (cluster/planner/
simulator.py: the real schedulers on a virtual clock, the profile as the
engines' speed): the fixed splits 1P3D, 2P2D, 3P1D, and the running sla
planner (cluster/planner/autoscale.py) in the loop (cluster/planner/elastic.py:
four slots, a new engine serving ``--cold-start-s`` after it was asked for),
twice: with rounds only (every ``--interval-s``), and with its watch between
rounds (every ``--watch-interval-s``: a re-plan on a measured SLO breach,
cluster/planner/watch.py), as ``tandem serve --planner sla`` runs by default.
A third planner row lets the planner move engines between the pools
(cluster/planner/moves.py: a draining engine of the pool with a surplus
serves in the other ``--switch-s`` after its streams migrated, instead of a
new engine's ``--cold-start-s``). ``--switch-s`` defaults to what the service
measured for the parts of a move that are not modelled step by step: a decode
scale-in's drain and stop (0.22 s max, benchmarks/scaling.py, docs/
benchmarks.md "Elastic pools") plus one health probe interval (0.5 s, the
gateway's ``health_interval_s``: the prefill registry is pushed after each
probe, and a prefill engine is ready once registered); the migrated streams
are simulated step by step as the service migrates them (a fresh prefill
handoff for a context of 256 tokens or more, elastic.py). The service's own
move (cluster/disagg/pool_move.py), measured by benchmarks/pool_move.py, takes
0.20 s with six streams migrating: it registers the engine itself instead of
waiting for a probe; the default stays the upper figure the results were run with.
Goodput counts requests meeting both SLOs (TTFT, and TPOT as
``vllm bench serve --goodput`` counts it) per second, per phase (by arrival)
and over the whole trace. A phase's best fixed split is taken from each split
run on that phase alone (in the whole trace a split's backlog from phase A
spills into phase B).

The profile is ``--profile FILE`` (``tandem profile``), else the GPU-shaped
one below (an 8B-class model on one GPU, written here, not measured: the
issue's H100 profile waits for a GPU session).

Targets (issue #28): in each phase >= 0.9x the best fixed split of that
phase; over the whole trace >= 1.3x the best single fixed split.

Run:  python benchmarks/planner.py [--phase-s 300] [--rate-a 16] [--rate-b 8] [--seed 0]
                                  [--watch-interval-s 1] [--switch-s 0.72]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from tandem.cluster.planner.autoscale import SlaPlanner  # noqa: E402
from tandem.cluster.planner.config import PlannerConfig  # noqa: E402
from tandem.cluster.planner.elastic import ElasticSimulator  # noqa: E402
from tandem.cluster.planner.metrics import summarize  # noqa: E402
from tandem.cluster.planner.profile import Profile, TransferCost, load_profile  # noqa: E402
from tandem.cluster.planner.simulator import SimRequest, Simulator  # noqa: E402

SLOTS = 4
# measured parts of a move (module doc): decode scale-in max + one health probe interval
MEASURED_DRAIN_S = 0.22
HEALTH_INTERVAL_S = 0.5
SPLITS = [(p, SLOTS - p) for p in range(1, SLOTS)]


def gpu_shaped_profile() -> Profile:
    """Prefill about 13k tokens/s; a decode step 12 ms + 0.2 ms per request +
    20 ns per context token; KV 128 KiB per token over 10 GB/s."""
    ctx = [1024, 16384, 65536, 262144]
    batch = [1, 16, 64, 128]
    return Profile(
        prefill_tokens=[256, 1024, 4096, 8192],
        prefill_time_s=[0.030, 0.080, 0.300, 0.620],
        decode_batch_sizes=batch,
        decode_context_tokens=ctx,
        decode_time_s=[[0.012 + 0.0002 * b + 2e-8 * c for c in ctx] for b in batch],
        transfer=TransferCost(bytes_per_s=10e9, latency_s=0.002, kv_bytes_per_token=131072),
        scheduler={
            "block_size": 16,
            "num_kv_blocks": 16384,
            "max_num_batched_tokens": 8192,
            "max_num_seqs": 128,
            "max_model_len": 8192,
        },
        meta={"model": "8B-class (assumed)", "device": "GPU-shaped, not measured"},
    )


def trace(phase_s: float, seed: int, rates: tuple[float, float]) -> list[SimRequest]:
    """Phase A: Poisson at rates[0], prompts ~256, answers ~512; phase B:
    rates[1], prompts ~4096, answers ~32 (each length uniform in +-20%)."""
    rng = random.Random(seed)
    out: list[SimRequest] = []
    for phase, (rate, prompt, answer) in enumerate(((rates[0], 256, 512), (rates[1], 4096, 32))):
        t = phase * phase_s
        while True:
            t += rng.expovariate(rate)
            if t >= (phase + 1) * phase_s:
                break
            n = int(prompt * rng.uniform(0.8, 1.2))
            ids = [rng.randrange(3, 30000) for _ in range(n)]
            out.append(SimRequest(t, ids, max(1, int(answer * rng.uniform(0.8, 1.2)))))
    return out


def goodputs(records, phase_s: float, ttft_ms: float, itl_ms: float) -> tuple[float, ...]:
    """Goodput of phase A, phase B (requests by arrival), and the whole trace."""
    out = []
    for lo, hi in ((0, phase_s), (phase_s, 2 * phase_s), (0, 2 * phase_s)):
        part = [r for r in records if lo <= r.arrival_s < hi]
        out.append(summarize(part, ttft_ms, itl_ms)["num_good"] / (hi - lo))
    return tuple(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", help="profile JSON (default: the GPU-shaped one above)")
    p.add_argument("--phase-s", type=float, default=300.0, help="virtual seconds per phase")
    p.add_argument("--rate-a", type=float, default=16.0, help="phase A requests/s")
    p.add_argument("--rate-b", type=float, default=8.0, help="phase B requests/s")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--itl-slo-ms", type=float, default=40.0)
    p.add_argument("--interval-s", type=float, default=10.0, help="planner interval")
    p.add_argument("--watch-interval-s", type=float, default=1.0,
                   help="the sla planner's watch between rounds (0: rounds only)")  # fmt: skip
    p.add_argument("--cold-start-s", type=float, default=15.0, help="engine start to serving")
    p.add_argument("--switch-s", type=float, default=MEASURED_DRAIN_S + HEALTH_INTERVAL_S,
                   help="a pool move's fixed cost, drain to serving in the other pool "
                   "(default: measured, module doc)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    profile = load_profile(args.profile) if args.profile else gpu_shaped_profile()
    requests = trace(args.phase_s, args.seed, (args.rate_a, args.rate_b))
    slo = (args.ttft_slo_ms, args.itl_slo_ms)
    rows = []
    alone = {}  # each split on each phase alone (no backlog from the other phase)
    for prefill, decode in SPLITS:
        start = time.monotonic()
        name = f"{prefill}P{decode}D"
        records = Simulator(profile, prefill, decode).run(requests)
        rows.append((name, goodputs(records, args.phase_s, *slo), ""))
        for k, lo in enumerate((0.0, args.phase_s)):
            part = [
                SimRequest(r.arrival_s - lo, r.prompt, r.output_len)
                for r in requests
                if lo <= r.arrival_s < lo + args.phase_s
            ]
            done = Simulator(profile, prefill, decode).run(part)
            alone[(name, k)] = summarize(done, *slo)["num_good"] / args.phase_s
        print(f"{name}: {time.monotonic() - start:.1f} s to simulate", flush=True)
    bounds = {"prefill": (1, SLOTS - 1), "decode": (1, SLOTS - 1)}
    for label, watch_s, switch_s in (
        ("sla planner, rounds only", 0.0, None),
        ("sla planner", args.watch_interval_s, None),
        ("sla planner, pool moves", args.watch_interval_s, args.switch_s),
    ):
        if label != "sla planner, rounds only" and not watch_s:
            continue
        config = PlannerConfig(
            planner="sla",
            planner_profile=args.profile or "(built in)",
            planner_interval_s=args.interval_s,
            planner_watch_interval_s=watch_s,
            ttft_slo_ms=args.ttft_slo_ms,
            itl_slo_ms=args.itl_slo_ms,
            planner_scale_out_cooldown_s=0.0,
            planner_scale_in_cooldown_s=3 * args.interval_s,
        )
        sim = ElasticSimulator(
            profile,
            2,
            2,
            SlaPlanner(config, bounds, profile, moves=switch_s is not None),
            interval_s=args.interval_s,
            cold_start_s=args.cold_start_s,
            slots=SLOTS,
            watch_interval_s=watch_s,
            switch_s=switch_s,
        )
        records = sim.run(requests)
        path = " ".join(f"{t:.0f}s:{p}P{d}D" for i, (t, p, d) in enumerate(sim.sizes)
                        if i == 0 or sim.sizes[i - 1][1:] != (p, d))  # fmt: skip
        watched = sum(1 for d in sim.decisions if "window_s" in d.inputs and d.action != "hold")
        if watched:
            path += f" ({watched} resizes between rounds)"
        if sim.moves:
            path += f" ({len(sim.moves)} engines moved)"
        rows.append((label, goodputs(records, args.phase_s, *slo), path))
    fixed = rows[: len(SPLITS)]
    best = [max(alone[(n, k)] for n, _, _ in fixed) for k in range(2)]
    best.append(max(r[1][2] for r in fixed))
    print(
        f"\nmachine: {machine()}; profile: {profile.meta or args.profile}; "
        f"{len(requests)} requests, phases of {args.phase_s:.0f} s (A: {args.rate_a}/s, "
        f"~256 in / ~512 out; B: {args.rate_b}/s, ~4096 in / ~32 out); SLOs TTFT "
        f"{args.ttft_slo_ms:.0f} ms, TPOT {args.itl_slo_ms:.0f} ms; planner every "
        f"{args.interval_s:.0f} s (watch every {args.watch_interval_s:g} s), cold start "
        f"{args.cold_start_s:.0f} s, pool move {args.switch_s:g} s, seed {args.seed}"
    )
    print(
        "| configuration | goodput A (req/s) | goodput B | goodput whole | "
        "A alone | B alone | sizes |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, (a, b, whole), sizes in rows:
        a1, b1 = alone.get((name, 0)), alone.get((name, 1))
        extra = f"{a1:.2f} | {b1:.2f}" if a1 is not None else "- | -"
        print(f"| {name} | {a:.2f} | {b:.2f} | {whole:.2f} | {extra} | {sizes} |")
    print()
    for name, planned, _ in rows[len(SPLITS) :]:
        print(
            f"{name} / best fixed split: phase A {planned[0] / max(best[0], 1e-9):.2f}x "
            f"(target >= 0.9), phase B {planned[1] / max(best[1], 1e-9):.2f}x (target >= 0.9), "
            f"whole trace {planned[2] / max(best[2], 1e-9):.2f}x (target >= 1.3)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
