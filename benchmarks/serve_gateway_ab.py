"""Gateway CPU per token, this tree against another, interleaved on one box.

``benchmarks/serve_gateway.py`` runs its servers one tree at a time; on a box
shared with other jobs, load moves between a "before" run and an "after" run.
This starts three servers at once (bare uvicorn SSE, the gateway of this
checkout, the gateway of ``--baseline-tree``, each its own process, each
started by its own tree's ``serve_gateway.py --serve``) and measures them in
turn, ``--repeats`` times, the order turning by one place each time, with the
same client (``--client``, as serve_gateway.py's): the server's CPU per
output token (utime + stime from /proc), whose minimum over the runs is the
figure least disturbed by other load, and tokens/s. The baseline tree is any
checkout (``git archive REV | tar -x -C DIR``); its gateway process is set up
as that tree's benchmark set it up.

Run: python benchmarks/serve_gateway_ab.py --baseline-tree DIR [--concurrency 64 256]
                                           [--num-rounds 3] [--repeats 7]
                                           [--client aiohttp|raw]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import serve_gateway  # noqa: E402
from benchmarks._machine import machine  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(tree: str, kind: str) -> tuple[subprocess.Popen, str]:
    """``kind`` served by ``tree``'s own benchmark script and code."""
    path = subprocess.check_output(
        [sys.executable, os.path.join(HERE, "benchmarks", "checkout.py"), tree], text=True
    ).strip()
    port = serve_gateway.free_port()
    script = os.path.join(tree, "benchmarks", "serve_gateway.py")
    proc = subprocess.Popen(
        [sys.executable, script, "--serve", kind, "--port", str(port)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": path},
    )
    url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + serve_gateway.START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline_s:
                serve_gateway.stop_server(proc)
                raise RuntimeError(f"{kind} of {tree} did not start") from None
            time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", required=True, help="another checkout's root")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--num-rounds", type=int, default=3, help="requests = rounds x streams")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--client", choices=["aiohttp", "raw"], default="aiohttp")
    args = parser.parse_args()
    serve_gateway.CLIENT[0] = args.client
    servers = {}
    try:
        servers["bare"] = start(HERE, "bare")
        servers["gateway (baseline)"] = start(os.path.abspath(args.baseline_tree), "gateway")
        servers["gateway (this tree)"] = start(HERE, "gateway")
        rows = []
        for concurrency in args.concurrency:
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            names = list(servers)
            for repeat in range(args.repeats):
                # the order turns by one place a repeat: the server measured right after
                # another ran with less CPU per token (a warmer box), so each takes every
                # place in the round alike
                k = repeat % len(names)
                for name in names[k:] + names[:k]:
                    proc, url = servers[name]
                    run = serve_gateway.measure(
                        url, proc.pid, concurrency, args.output_len, args.num_rounds
                    )
                    runs[name].append(run)
            rows.append((concurrency, os.getloadavg()[0], runs))
    finally:
        for proc, _ in servers.values():
            serve_gateway.stop_server(proc)
    print("serve_gateway_ab: server CPU per output token, interleaved runs")
    print(f"machine: {machine()}")
    print(
        f"workload: input {serve_gateway.INPUT_LEN} / output {args.output_len} tokens, "
        f"{args.num_rounds} x streams requests per run, {args.repeats} runs per server, "
        f"baseline tree {args.baseline_tree}, client {args.client}, the order turning each run"
    )
    print(
        "| streams | server | CPU us/tok min | CPU us/tok median | bare / server (min) "
        "| tok/s median | load after |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for concurrency, load, runs in rows:
        bare_min = min(run["cpu_us_per_tok"] for run in runs["bare"])
        for name, server_runs in runs.items():
            cpu = [run["cpu_us_per_tok"] for run in server_runs]
            tok_s = statistics.median(run["tok_s"] for run in server_runs)
            print(
                f"| {concurrency} | {name} | {min(cpu):.1f} | {statistics.median(cpu):.1f} "
                f"| {bare_min / min(cpu):.2f} | {tok_s:.0f} | {load:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
