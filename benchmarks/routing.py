"""KV-aware routing vs round-robin and least-load on a multi-turn,
shared-prefix trace (cluster/cli/trace_replay.py), same seed for every run.

Setups: 2 prefill + 2 decode engines, and 4 colocated engines. For each
router policy a fresh service (cold caches) replays the same synthetic
trace (cluster/cli/trace_replay.py SynthConfig: 32 chat/RAG sessions, 184
requests, ~2k-token prompts) through `tandem bench --trace` in its own
process. Then the 2P+2D setup replays a trace of the same shape with no
sharing at all (the control: routing must cost no throughput there; fewer
sessions, since nothing is cached and every prompt is computed).

Reported per run:
  hit rate        prompt tokens taken from cache / prompt tokens, from each
                  response's usage.prompt_tokens_details.cached_tokens: the
                  hit of the engine that computed the prompt (P, or D/colocated
                  when it prefilled locally; a KV read from P is not a hit)
  oracle          every block that exists anywhere, nothing evicted
                  (trace_replay.oracle_hit_tokens): the best any router can do
  prefill tok     prompt tokens computed, summed over engines (scheduler
                  stats). It is prompt tokens x (1 - hit rate) plus one token
                  per remote request (D computes P's sampled token, which
                  joins its prompt) plus any recompute after a preemption
  KV read         bytes decode engines read over NIXL
  TTFT p50 / p99, output tok/s (client side)

Targets (issue 16): kv-aware hit rate >= 90% of the oracle; kv-aware TTFT
p50 at most half of least-load's; no throughput loss without sharing.

Model: the random 4-layer Llama of serve_interference.py (byte tokenizer),
fp32, one torch thread per engine.

Run: python benchmarks/routing.py [--num-sessions 32] [--time-scale 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from benchmarks.serve_interference import MODEL, make_checkpoint  # noqa: E402
from tandem.cluster.cli.serve import ServiceThread  # noqa: E402
from tandem.cluster.cli.settings import ServeConfig, serve_config  # noqa: E402
from tandem.cluster.cli.trace_replay import SynthConfig, oracle_hit_tokens, synthesize  # noqa: E402

# 8192 blocks (128k tokens, 256 MiB) per engine: the trace's working set
# fits a pool, so the oracle (nothing evicted) is a fair bar for routing.
ENGINE = {
    "num_kv_blocks": 8192,
    "max_num_seqs": 32,
    "max_model_len": 4096,
    "max_num_batched_tokens": 1024,
    "block_size": 16,
    "torch_threads": 1,
}
SETUPS = {
    "2P+2D": dict(prefill=2, decode=2, colocated=0),
    "4 colocated": dict(prefill=0, decode=0, colocated=4),
}
POLICIES = ("round-robin", "least-load", "kv-aware")
VOCAB = 256  # the byte tokenizer's plain bytes


def _bench(url: str, trace: str, time_scale: float, block_tokens: int) -> dict:
    args = [
        sys.executable, "-m", "tandem.cluster", "bench", "--url", url, "--json", "--seed", "0",
        "--trace", trace, "--time-scale", str(time_scale),
        "--trace-block-tokens", str(block_tokens), "--vocab-size", str(VOCAB),
        "--request-timeout-s", "600",
    ]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if out.returncode not in (0, 1):
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout)


def _warmup(url: str) -> None:
    """Handshakes and first allocations; random prompts share no block with the trace."""
    args = [
        sys.executable, "-m", "tandem.cluster", "bench", "--url", url, "--json", "--seed", "99",
        "--num-requests", "8", "--concurrency", "4", "--input-len", "40",
        "--output-len", "4", "--vocab-size", str(VOCAB),
    ]  # fmt: skip
    subprocess.run(args, capture_output=True, text=True, timeout=600, check=True)


def _ttft_by_path(url: str) -> dict[str, tuple[float, int]]:
    """Gateway TTFT histogram per path: ``{"local": (sum_s, count), "remote": ...}``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, list[float]] = {"local": [0.0, 0], "remote": [0.0, 0]}
    for line in text.splitlines():
        for path in out:
            key = f'time_to_first_token_seconds_%s{{path="{path}"}} '
            if line.startswith("tandem:" + key % "sum"):
                out[path][0] = float(line.split()[-1])
            elif line.startswith("tandem:" + key % "count"):
                out[path][1] = int(float(line.split()[-1]))
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def run_one(model: str, pools: dict, policy: str, trace: str, a: argparse.Namespace) -> dict:
    config = serve_config(
        ray_dashboard=False,
        model=model,
        router=policy,
        disagg_min_tokens=a.disagg_min_tokens,
        router_busy_threshold=a.router_busy_threshold,
        **pools,
        **ENGINE,
    )
    with ServiceThread(config) as svc:
        backend = svc.service.backend
        _warmup(svc.base_url)
        before = svc.run(backend.call_all("stats"))
        decisions_before = backend.routing.decisions()
        ttft_before = _ttft_by_path(svc.base_url)
        summary = _bench(svc.base_url, trace, a.time_scale, a.block_tokens)
        ttft_after = _ttft_by_path(svc.base_url)
        after = svc.run(backend.call_all("stats"))
        decisions = {
            k: n - decisions_before.get(k, 0) for k, n in backend.routing.decisions().items()
        }

    def total(key: str, roles=("prefill", "decode", "colocated")) -> float:
        return sum(
            getattr(after[e].scheduler, key) - getattr(before[e].scheduler, key)
            for e in after
            if after[e].role in roles
        )

    def kv_read() -> float:
        def b(s):
            return s.kv_transfer.transfer_bytes_total if s.kv_transfer is not None else 0.0

        return sum(b(after[e]) - b(before[e]) for e in after if after[e].role == "decode")

    summary["prefill_tokens"] = total("num_prompt_tokens")
    summary["kv_read_bytes"] = kv_read()
    summary["decisions"] = decisions
    summary["ttft_mean_ms_by_path"] = {
        path: round(1000 * (t - ttft_before[path][0]) / (n - ttft_before[path][1]))
        for path, (t, n) in ttft_after.items()
        if n > ttft_before[path][1]
    }

    def delta(e: str, key: str) -> int:
        return getattr(after[e].scheduler, key) - getattr(before[e].scheduler, key)

    summary["per_engine"] = {
        e: {
            "prompt_tok": delta(e, "num_prompt_tokens"),
            "gen_tok": delta(e, "num_generation_tokens"),
        }
        for e in sorted(after)
    }
    summary["hit_rate"] = summary["prefix_hit_rate"]
    return summary


def _row(setup: str, trace_name: str, policy: str, oracle: float, r: dict) -> str:
    return (
        f"| {setup} | {trace_name} | {policy} | {r['hit_rate']:.3f} | {oracle:.3f} "
        f"| {r['prefill_tokens']:.0f} | {r['kv_read_bytes'] / 2**20:.1f} MiB "
        f"| {r['ttft_ms']['p50']:.0f} ms | {r['ttft_ms']['p99']:.0f} ms "
        f"| {r['output_token_throughput']:.1f} | {r['num_failed']} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = SynthConfig()
    p.add_argument("--num-sessions", type=int, default=d.num_sessions)
    p.add_argument(
        "--control-sessions", type=int, default=8, help="sessions of the no-sharing trace"
    )
    p.add_argument("--session-rate-per-s", type=float, default=d.session_rate_per_s)
    p.add_argument("--block-tokens", type=int, default=d.block_tokens)
    p.add_argument(
        "--disagg-min-tokens",
        type=int,
        default=256,
        help="serve's flag, same for every policy (kv-aware: uncached tokens on D)",
    )
    p.add_argument(
        "--router-busy-threshold",
        type=float,
        default=ServeConfig().routing.busy_threshold,
        help="serve's flag (kv-aware; 100 = off)",
    )
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--no-control", action="store_true", help="skip the no-sharing trace")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import ray

    load_before = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="tandem-routing-")
    traces = {}
    for name, share in (("shared", True), ("no sharing", False)):
        cfg = SynthConfig(
            num_sessions=a.num_sessions if share else a.control_sessions,
            block_tokens=a.block_tokens,
            session_rate_per_s=a.session_rate_per_s,
            share_prefixes=share,
            seed=a.seed,
        )
        rows = synthesize(cfg)
        path = os.path.join(tmp, f"{name.replace(' ', '_')}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        total_in = sum(r["input_length"] for r in rows)
        traces[name] = (path, oracle_hit_tokens(rows, a.block_tokens) / total_in, rows)
    runs = [(s, "shared") for s in a.setups.split(",")]
    if not a.no_control:
        runs.append(("2P+2D", "no sharing"))
    ray.init(include_dashboard=False, log_to_driver=False)
    model = make_checkpoint(os.path.join(tmp, "model"))
    results = []
    try:
        for setup, trace_name in runs:
            path, oracle, _ = traces[trace_name]
            for policy in a.policies.split(","):
                r = run_one(model, SETUPS[setup], policy, path, a)
                print(
                    f"# {setup} {trace_name} {policy}: {json.dumps(r['decisions'])} "
                    f"{json.dumps(r['per_engine'])} TTFT mean by path {r['ttft_mean_ms_by_path']}",
                    flush=True,
                )
                results.append((setup, trace_name, policy, oracle, r))
                print(f"# {_row(*results[-1])} load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        ray.shutdown()
    rows = traces["shared"][2]
    print(f"machine: {machine()}; load average (1 min) before: {load_before:.1f}")
    print(
        f"workload: synthetic trace seed {a.seed}, {a.num_sessions} sessions "
        f"({len(rows)} requests, {a.block_tokens}-token blocks, sessions {a.session_rate_per_s}/s, "
        f"time x{a.time_scale}, --disagg-min-tokens {a.disagg_min_tokens}, "
        f"--router-busy-threshold {a.router_busy_threshold:g}; no-sharing control: "
        f"{a.control_sessions} sessions, {len(traces['no sharing'][2])} requests); "
        f"random Llama {MODEL} fp32; engines {ENGINE}"
    )
    hdr = (
        "| setup | trace | router | hit rate | oracle | prefill tok | KV read "
        "| TTFT p50 | TTFT p99 | output tok/s | failed |"
    )
    print(hdr)
    print("|---|---|---|" + "---:|" * 8)
    for row in results:
        print(_row(*row))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
