"""The gateway's instructions and simulated cache misses per streamed token (cachegrind).

``gateway_token_path.py`` times the gateway's ASGI app in-process; on a box shared with
other jobs its CPU figures move by more than most changes to the token path. This
counts instead: each app (the gateway, ``serve_gateway.py``'s bare endpoint) runs under
valgrind's cachegrind with the same in-process harness (``--streams`` concurrent
streaming completions of 128 tokens, a ``send`` that only counts), once with a warm-up
only and once with the warm-up plus ``--rounds`` rounds; the difference over the tokens
of those rounds is per token, start-up excluded. Instructions (Ir) do not depend on the
load; the cache misses are cachegrind's simulation (first-level instruction and data
caches of 32 KiB, a last level of ``--ll-kib``, default 1 MiB: this box's L2), not
hardware counters. Per token includes each request's own work (parse, route, log) over
its 128 tokens.

``--baseline-tree DIR`` counts another checkout's gateway beside this one's (its
``tandem`` package, this tree's harness). Under cachegrind a run takes about 50x its
native time (about 90 s each here, mostly start-up); ``--jobs`` runs that many at once.

Run: python benchmarks/gateway_instructions.py [--streams 64 256] [--output-tokens 16 128]
     [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._machine import machine  # noqa: E402

NUM_TOKENS = 128
EVENTS = {
    "Ir": "I   refs",
    "I1 miss": "I1  misses",
    "D1 miss": "D1  misses",
    "LL miss": "LL misses",
}


def child(kind: str, rounds: int, streams: int, num_tokens: int) -> None:
    """One app in this process, set up as ``gateway_token_path.py`` sets it up."""
    from benchmarks import gateway_token_path as harness
    from tandem.cluster.gateway.torch_free import bar_torch

    bar_torch()
    import logging

    from benchmarks.serve_gateway import bare_app
    from tandem.cluster.gateway.app import create_app
    from tandem.cluster.gateway.heap import freeze_startup_heap
    from tandem.cluster.gateway.null_backend import NullBackend
    from tandem.cluster.observability.logging_setup import make_handler

    root = logging.getLogger()  # as `tandem serve`: INFO, one line per request
    root.addHandler(make_handler("text", open(os.devnull, "w")))  # noqa: SIM115
    root.setLevel(logging.INFO)
    app = create_app(NullBackend.tiny()) if kind == "gateway" else bare_app()
    freeze_startup_heap()
    body = harness.request_body(num_tokens)

    events = [0]

    async def drive() -> None:  # the harness's runs, on one loop as gateway_token_path runs them
        await harness.run_once(app, body, 1, streams, num_tokens, events)  # warm-up
        if rounds:
            await harness.run_once(app, body, rounds, streams, num_tokens, events)

    asyncio.run(drive())
    # every stream streamed (a token per body event, the first and last may carry more): a run
    # that streamed nothing would count nothing and say so
    expected = (1 + rounds) * streams * (num_tokens - 1)
    if events[0] < expected:
        raise RuntimeError(f"{kind}: {events[0]} body events, expected at least {expected}")
    print(f"gateway_instructions child: {kind} sent {events[0]} body events")


def checkout_path(tree: str) -> str:
    """What to put on ``PYTHONPATH`` to import ``tree``'s ``tandem``."""
    return subprocess.check_output(
        [sys.executable, os.path.join(ROOT, "benchmarks", "checkout.py"), tree], text=True
    ).strip()


def counts(
    path: str, kind: str, rounds: int, streams: int, num_tokens: int, ll_kib: int
) -> dict[str, int]:
    """cachegrind's totals for one child run with ``path`` first on ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    argv = [
        "valgrind", "--tool=cachegrind", "--cache-sim=yes", "--cachegrind-out-file=/dev/null",
        "--I1=32768,8,64", "--D1=32768,8,64", f"--LL={ll_kib * 1024},8,64",
        sys.executable, os.path.abspath(__file__), "--child", kind, str(rounds), str(streams), str(num_tokens),
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} under cachegrind failed:\n{done.stderr[-2000:]}")
    out = {}
    for name, label in EVENTS.items():
        match = re.search(rf"{re.escape(label)}:\s+([\d,]+)", done.stderr)
        if match is None:
            raise RuntimeError(f"no {label!r} in cachegrind's summary:\n{done.stderr[-2000:]}")
        out[name] = int(match.group(1).replace(",", ""))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=32768, help="streamed tokens counted per run")
    parser.add_argument(
        "--output-tokens",
        type=int,
        nargs="+",
        default=[NUM_TOKENS],
        help="tokens per request; with two lengths, also each app's per-request and per-token split",
    )
    parser.add_argument("--baseline-tree", help="another checkout's root, counted beside this one")
    parser.add_argument("--ll-kib", type=int, default=1024, help="simulated last-level cache")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--no-bare", action="store_true", help="count the gateways only (bare's counts are fixed)"
    )
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]), int(args.child[3]))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed", file=sys.stderr)
        return 1
    apps = [("bare", ROOT, "bare"), ("gateway (this tree)", ROOT, "gateway")]
    if args.baseline_tree:
        apps.insert(1, ("gateway (baseline)", os.path.abspath(args.baseline_tree), "gateway"))
    if args.no_bare:
        apps = apps[1:]
    # each tree's path made once here: parallel jobs making it at once collide
    paths = {tree: checkout_path(tree) for tree in {tree for _, tree, _ in apps}}
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for streams in args.streams:
            for length in args.output_tokens:
                rounds = max(1, args.tokens // (streams * length))
                for name, tree, kind in apps:
                    for r in (0, rounds):
                        jobs[name, streams, length, r] = pool.submit(
                            counts, paths[tree], kind, r, streams, length, args.ll_kib
                        )
        results = {key: job.result() for key, job in jobs.items()}
    print("gateway_instructions: per streamed token in-process, cachegrind (simulated caches)")
    print(f"machine: {machine()}; valgrind, I1/D1 32 KiB, LL {args.ll_kib} KiB")
    print(
        "workload: N streams x M tokens, null backend, ASGI app driven in-process "
        "(no HTTP, no socket); run with rounds minus run without, per token"
    )
    print("| streams | tokens/request | app | instructions | I1 misses | D1 misses | LL misses |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    per_token: dict[tuple[str, int, int], dict[str, float]] = {}
    for streams in args.streams:
        for length in args.output_tokens:
            rounds = max(1, args.tokens // (streams * length))
            tokens = rounds * streams * length
            for name, _, _ in apps:
                after = results[name, streams, length, rounds]
                before = results[name, streams, length, 0]
                per = {k: (after[k] - before[k]) / tokens for k in EVENTS}
                per_token[name, streams, length] = per
                print(
                    f"| {streams} | {length} | {name} | {per['Ir']:.0f} | {per['I1 miss']:.0f} "
                    f"| {per['D1 miss']:.0f} | {per['LL miss']:.1f} |"
                )
    if len(args.output_tokens) == 2:
        print_split(per_token, args.streams, args.output_tokens, [name for name, _, _ in apps])
    return 0


def print_split(
    per_token: dict[tuple[str, int, int], dict[str, float]],
    streams_list: list[int],
    lengths: list[int],
    names: list[str],
) -> None:
    """Solve ``per request + tokens x per token`` from the two lengths' totals per request."""
    short, long = sorted(lengths)
    print(f"\nper request and per token, solved from {short} and {long} tokens per request:")
    print("| streams | app | Ir per request | Ir per token | LL per request | LL per token |")
    print("|---:|---|---:|---:|---:|---:|")
    for streams in streams_list:
        for name in names:
            split = {}
            for key in ("Ir", "LL miss"):
                a = per_token[name, streams, short][key] * short  # per request at each length
                b = per_token[name, streams, long][key] * long
                token = (b - a) / (long - short)
                split[key] = (a - token * short, token)
            print(
                f"| {streams} | {name} | {split['Ir'][0]:.0f} | {split['Ir'][1]:.0f} "
                f"| {split['LL miss'][0]:.0f} | {split['LL miss'][1]:.1f} |"
            )


if __name__ == "__main__":
    sys.exit(main())
