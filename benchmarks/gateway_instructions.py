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

Run: python benchmarks/gateway_instructions.py [--streams 64 256] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
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


def child(kind: str, rounds: int, streams: int) -> None:
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
    body = json.dumps(
        {"model": "tiny", "prompt": list(range(5, 37)), "max_tokens": NUM_TOKENS,
         "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    ).encode()  # fmt: skip
    harness.run_once(app, body, 1, streams)  # warm-up
    if rounds:
        harness.run_once(app, body, rounds, streams)


def counts(tree: str, kind: str, rounds: int, streams: int, ll_kib: int) -> dict[str, int]:
    """cachegrind's totals for one child run."""
    path = subprocess.check_output(
        [sys.executable, os.path.join(ROOT, "benchmarks", "checkout.py"), tree], text=True
    ).strip()
    env = {**os.environ, "PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    argv = [
        "valgrind", "--tool=cachegrind", "--cache-sim=yes", "--cachegrind-out-file=/dev/null",
        "--I1=32768,8,64", "--D1=32768,8,64", f"--LL={ll_kib * 1024},8,64",
        sys.executable, os.path.abspath(__file__), "--child", kind, str(rounds), str(streams),
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
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=32768, help="streamed tokens counted per run")
    parser.add_argument("--baseline-tree", help="another checkout's root, counted beside this one")
    parser.add_argument("--ll-kib", type=int, default=1024, help="simulated last-level cache")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed", file=sys.stderr)
        return 1
    apps = [("bare", ROOT, "bare"), ("gateway (this tree)", ROOT, "gateway")]
    if args.baseline_tree:
        apps.insert(1, ("gateway (baseline)", os.path.abspath(args.baseline_tree), "gateway"))
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for streams in args.streams:
            rounds = max(1, args.tokens // (streams * NUM_TOKENS))
            for name, tree, kind in apps:
                for r in (0, rounds):
                    jobs[name, streams, r] = pool.submit(
                        counts, tree, kind, r, streams, args.ll_kib
                    )
        results = {key: job.result() for key, job in jobs.items()}
    print("gateway_instructions: per streamed token in-process, cachegrind (simulated caches)")
    print(f"machine: {machine()}; valgrind, I1/D1 32 KiB, LL {args.ll_kib} KiB")
    print(
        f"workload: N streams x {NUM_TOKENS} tokens, null backend, ASGI app driven in-process "
        f"(no HTTP, no socket); run with rounds minus run without, per token"
    )
    print("| streams | app | instructions | I1 misses | D1 misses | LL misses |")
    print("|---:|---|---:|---:|---:|---:|")
    for streams in args.streams:
        rounds = max(1, args.tokens // (streams * NUM_TOKENS))
        tokens = rounds * streams * NUM_TOKENS
        for name, _, _ in apps:
            after, before = results[name, streams, rounds], results[name, streams, 0]
            per = {k: (after[k] - before[k]) / tokens for k in EVENTS}
            print(
                f"| {streams} | {name} | {per['Ir']:.0f} | {per['I1 miss']:.0f} "
                f"| {per['D1 miss']:.0f} | {per['LL miss']:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
