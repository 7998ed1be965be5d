"""Decode migration time: decode engine killed -> next token at the client.

A real service (local Ray, 1 prefill + 2 decode engines, the `tiny` model)
runs STREAMS concurrent greedy streams whose prompts are CONTEXT tokens long;
once every stream has a few tokens, the decode engine holding the most of
them is killed (``ray.kill``, Ray restarts it). Its streams migrate to the
other decode engine (cluster/disagg/migration.py). Per migrated stream: the time
from the kill to its first token after the migration's silence
(tests/chaos/harness.py ``resume_time``), and whether its tokens equal the
undisturbed run's (asserted).

The surviving decode engine gets the migrated context's KV three ways, one
service per mode; every round first forgets the prompts the undisturbed run
cached (``reset_prefix_cache`` on every engine):

    recompute   the decode engine prefills prompt + sent tokens itself
                (--migration-handoff-min-tokens above the context)
    handoff     the prefill engine recomputes it and the decode engine reads
                the KV over NIXL (--migration-handoff-min-tokens 0)
    prefix      as recompute, but both decode engines already hold the
                prompts in their prefix cache (warmed one at a time, the
                other drained): only the sent tokens are recomputed

Run:  python benchmarks/migration.py [--context 1000] [--streams 8] [--rounds 3]
Target: p99 < 1 s at a 1k-token context.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from tandem.cluster.cli.serve import ServiceThread  # noqa: E402
from tandem.cluster.cli.settings import serve_config  # noqa: E402
from tests.chaos.harness import Tally, Workload, verdict  # noqa: E402
from tests.chaos.service import requests_on, reset_prefix_caches  # noqa: E402

ENGINE = {"num_kv_blocks": 1024, "max_num_seqs": 32, "max_model_len": 2048}
MODES = ("recompute", "handoff", "prefix")
MAX_TOKENS = 256  # long enough that every stream still runs at the kill


def config(mode: str, namespace: str):
    return serve_config(
        model="tiny",
        ray_dashboard=False,
        prefill=1,
        decode=2,
        max_restarts=100,
        ray_namespace=namespace,
        admin_api_key="bench",
        migration_handoff_min_tokens=0 if mode == "handoff" else 1_000_000,
        **ENGINE,
    )


def prompts(context: int, streams: int, round_: int) -> list[list[int]]:
    rng = random.Random(round_)
    return [[rng.randrange(3, 250) for _ in range(context)] for _ in range(streams)]


def admin(svc, path: str, engine_id: str) -> dict:
    import httpx

    r = httpx.post(
        svc.base_url + path,
        json={"engine_id": engine_id},
        headers={"Authorization": "Bearer bench"},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()


def wait_ready(svc, engine_id: str, old_epoch: int = 0, deadline_s: float = 600.0) -> None:
    e = svc.service.backend.engines[engine_id]
    end = time.monotonic() + deadline_s
    while not (e.state.ready and e.state.epoch != old_epoch):
        if time.monotonic() > end:
            raise TimeoutError(f"{engine_id} not ready within {deadline_s} s")
        time.sleep(0.05)


def warm_both_decode_engines(svc, ps: list[list[int]]) -> None:
    """Each decode engine caches the prompts (the other drained meanwhile), so
    wherever a stream runs, the engine it migrates to holds its prompt."""
    for drained in ("decode-0", "decode-1"):
        admin(svc, "/admin/drain", drained)
        warm = Workload(svc.base_url, "greedy", len(ps), prompts=ps, max_tokens=2)
        assert not any(warm.finish())
        admin(svc, "/admin/undrain", drained)
        wait_ready(svc, drained)


def run_mode(mode: str, args) -> tuple[Tally, int, str]:
    import ray

    tally = Tally(mode)
    moved_total = 0
    loads = []
    namespace = f"bench-migration-{mode}-{os.getpid()}"
    with ServiceThread(config(mode, namespace)) as svc:
        backend = svc.service.backend
        for round_ in range(args.rounds):
            ps = prompts(args.context, args.streams, round_)
            ref = Workload(svc.base_url, "greedy", args.streams, prompts=ps, max_tokens=MAX_TOKENS)
            assert not any(ref.finish())
            # the undisturbed run cached the prompts: forget them, then cache them
            # on both decode engines for "prefix" only
            reset_prefix_caches(svc)
            if mode == "prefix":
                warm_both_decode_engines(svc, ps)
            w = Workload(svc.base_url, "greedy", args.streams, prompts=ps, max_tokens=MAX_TOKENS)
            w.wait_tokens(4)
            # kill the decode engine holding the most streams (kv-aware routing
            # may put them all on one)
            held = {eid: requests_on(svc, eid) for eid in ("decode-0", "decode-1")}
            target = max(held, key=lambda eid: len(held[eid]))
            print(
                f"{mode} round {round_}: streams per decode engine "
                f"{ {eid: len(ids) for eid, ids in held.items()} }, killing {target}",
                flush=True,
            )
            epoch = backend.engines[target].state.epoch
            loads.append(os.getloadavg()[0])
            fault_s = time.monotonic()
            ray.kill(ray.get_actor(target, namespace=namespace), no_restart=False)
            hung = w.finish()
            tally.add("greedy", w.results, ref.results, hung, fault_s, held[target])
            moved_total += len(held[target])
            bad = [verdict(r, x, h) for r, x, h in zip(w.results, ref.results, hung, strict=True)]
            assert set(bad) == {"identical"}, tally.details
            wait_ready(svc, target, epoch)
    return tally, moved_total, " ".join(f"{x:.1f}" for x in loads)


def main() -> int:
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=1000, help="prompt tokens per stream")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams")
    p.add_argument("--rounds", type=int, default=3, help="kills per mode")
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for mode in args.modes.split(","):
            tally, moved, loads = run_mode(mode, args)
            ms = sorted(tally.migration_s)
            p50 = statistics.median(ms) * 1000 if ms else float("nan")
            p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))] * 1000 if ms else float("nan")
            rows.append(
                f"| {mode} | {args.context} | {moved} | {tally.identical}/{tally.requests} | "
                f"{p50:.0f} | {p99:.0f} | {ms[-1] * 1000 if ms else float('nan'):.0f} | {loads} |"
            )
            print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    print(f"\nmachine: {machine()}; {args.streams} streams x {args.rounds} kills per mode")
    print(
        "| KV for the new engine | context tokens | migrated streams | identical | "
        "p50 ms | p99 ms | max ms | load avg (1 min) at each kill |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
