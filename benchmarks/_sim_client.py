"""benchmarks/simulator.py's client: ``tandem bench --trace``'s replay of a
trace against a served ``tiny`` model, in a process of its own.

The client is ``tandem bench --trace``'s code (cluster/cli/bench.py: its
workload, stream reader and summary) with one addition: ``logit_bias`` keeps
the answers to printable ASCII (simulator.py's docstring says why). It
returns the summary with each request's client stamps (id, send time, TTFT;
what _sim_breakdown.py joins with the gateway's records) and, asked for, each
request's ITLs in trace order (the decode sweep, _sim_sweep.py).

Run (what ``replay_in_process`` does):
    python benchmarks/_sim_client.py URL TRACE SEED [--per-request]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

# printable ASCII only: every token is a character of its own (simulator.py's docstring)
ASCII = range(32, 127)
TINY_VOCAB = 262


async def replay(url: str, trace: str, seed: int, per_request: bool = False) -> dict:
    """``tandem bench --trace``'s run with ASCII-only answers; its summary dict
    (with ``per_request``, each request's id and ITLs in ms, in trace order)."""
    import aiohttp

    from tandem.cluster.cli import bench
    from tandem.cluster.cli.trace_replay import trace_workload

    config = bench.BenchConfig(url=url, trace=trace, seed=seed, request_timeout_s=300.0)
    bias = {str(t): -100 for t in range(TINY_VOCAB) if t not in ASCII}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        model, vocab_size = await bench._server_info(session, config)
        prompts, outs, offsets = trace_workload(trace, vocab_size, seed, 1.0, 512)
        sent = [0.0] * len(prompts)  # each request's send time (perf_counter: the box's clock)

        async def one(i: int) -> bench.RequestResult:
            result = bench.RequestResult(prompt_len=len(prompts[i]))
            payload = {
                "model": model, "prompt": prompts[i], "max_tokens": outs[i],
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "logit_bias": bias,
            }  # fmt: skip
            start_s = sent[i] = time.perf_counter()
            try:
                await asyncio.wait_for(
                    bench._stream(session, f"{url}/v1/completions", payload, start_s, result),
                    config.request_timeout_s,
                )
            except asyncio.TimeoutError:
                result.error = "timeout"
            result.latency_s = time.perf_counter() - start_s
            result.ok = not result.error and result.num_output_tokens > 0
            return result

        cpu0 = time.process_time()  # the client's CPU streaming (not its start-up)
        results, duration_s = await bench.send_at(offsets, one)
        cpu_s = time.process_time() - cpu0
    # per request: what _sim_breakdown.py joins with the gateway's records
    stamps = [[r.request_id, sent[i], r.ttft_s] for i, r in enumerate(results) if r.ok]
    summary = bench.summarize(list(results), duration_s, config)
    if per_request:
        summary["per_request"] = [[r.request_id, [x * 1000 for x in r.itls_s]] for r in results]
    return {**summary, "client_cpu_s": cpu_s, "stamps": stamps}


def replay_in_process(url: str, trace: str, seed: int, per_request: bool = False) -> dict:
    """``replay`` in a process of its own (the client's CPU apart from the
    gateway's, in the benchmark's accounting)."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), url, trace, str(seed),
         *(["--per-request"] if per_request else [])],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"replay failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("trace")
    p.add_argument("seed", type=int)
    p.add_argument("--per-request", action="store_true")
    args = p.parse_args()
    got = replay(args.url, args.trace, args.seed, args.per_request)
    print(json.dumps(asyncio.run(got)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
