"""Prefix-cache hit rate and block contiguity under eviction pressure, for
the block pool's two eviction modes (``BlockPool(evict_runs=True|False)``).

No model: the Scheduler runs with a fake runner (one token per request whose
chunk reached the end of its tokens, as benchmarks/scheduler_step.py). The
workload is shared-prefix traffic: NUM_PREFIXES system prompts of 128-1536
tokens with Zipf popularity (a few hot ones, a long tail), each request one of
them plus a unique suffix, and a share of wholly unique prompts; outputs of
8-128 tokens. Arrivals are closed-loop (the waiting queue is kept at
QUEUE_DEPTH requests), so both modes see the same request order. The cache is
several times smaller than the shared prefixes' blocks.

hit rate = prefix tokens hit / prompt tokens admitted (the Scheduler's
prefix_cache_hits / prefix_cache_queries); runs / request = runs of
consecutive block ids in a request's block table when its prompt is computed
(a KV READ posts one descriptor per run), also shown per block. Run:
python benchmarks/prefix_eviction.py [--requests 3000] [--seeds 0 1 2] [--num-blocks 1024 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from tandem.scheduler import Request, Scheduler, SchedulerConfig  # noqa: E402
from tandem.scheduler.messages import ModelRunnerOutput  # noqa: E402
from tandem.wire.engine_protocol import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
NUM_PREFIXES = 100
ZIPF_S = 1.0
SHARED_FRACTION = 0.75
MAX_NUM_SEQS = 8
QUEUE_DEPTH = 4


def workload(seed: int, num_requests: int) -> list[tuple[list[int], int]]:
    """``num_requests`` (prompt token ids, max_tokens) pairs: a shared prefix
    (Zipf-ranked, 128-1536 tokens) plus a unique 16-256 token suffix with
    probability SHARED_FRACTION, else a unique 256-1024 token prompt."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(32000) for _ in range(BLOCK_SIZE * rng.randrange(8, 97))]
        for _ in range(NUM_PREFIXES)
    ]
    weights = [1.0 / (rank + 1) ** ZIPF_S for rank in range(NUM_PREFIXES)]
    out = []
    for _ in range(num_requests):
        if rng.random() < SHARED_FRACTION:
            (prefix,) = rng.choices(prefixes, weights)
            prompt = prefix + [rng.randrange(32000) for _ in range(rng.randrange(16, 257))]
        else:
            prompt = [rng.randrange(32000) for _ in range(rng.randrange(256, 1025))]
        out.append((prompt, rng.randrange(8, 129)))
    return out


def num_runs(block_ids: list[int]) -> int:
    return sum(1 for i, b in enumerate(block_ids) if i == 0 or b != block_ids[i - 1] + 1)


def simulate(
    requests: list[tuple[list[int], int]], num_blocks: int, evict_runs: bool
) -> dict[str, float]:
    """Serve ``requests`` through a Scheduler with ``num_blocks`` KV blocks;
    hit rate, runs per request and runs per block (see the module docstring)."""
    cfg = SchedulerConfig(
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=2048,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=4096,
        enable_prefix_caching=True,
    )
    s = Scheduler(cfg)
    s.kv.pool.evict_runs = evict_runs  # pool is untouched so far
    pending = iter(enumerate(requests))
    lens: dict[str, list[int]] = {}  # rid -> [num_computed, num_tokens]
    runs, blocks = [], []
    num_waiting = 0
    while True:
        while len(s.waiting) < QUEUE_DEPTH:
            nxt = next(pending, None)
            if nxt is None:
                break
            i, (prompt, max_tokens) = nxt
            s.add_request(
                Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            )
            num_waiting += 1
        if not s.has_work():
            break
        so = s.schedule()
        out = ModelRunnerOutput()
        for nr in so.scheduled_new_reqs:
            lens[nr.req_id] = [nr.num_computed_tokens, len(nr.all_token_ids), 1]
        for rid in so.finished_req_ids:
            lens.pop(rid, None)
        for rid, n in so.num_scheduled_tokens.items():
            st = lens[rid]
            st[0] += n
            out.req_ids.append(rid)
            if st[0] == st[1]:
                if st[2]:  # the prompt is computed: its block table is final
                    ids = s.kv.get_block_ids(rid)
                    runs.append(num_runs(ids))
                    blocks.append(len(ids))
                    st[2] = 0
                st[1] += 1
                out.sampled_token_ids.append([7])
            else:
                out.sampled_token_ids.append([])
        s.update_from_output(so, out)
    s.check_integrity()
    assert num_waiting == len(requests)
    return {
        "hit_rate": s.prefix_cache_hits / s.prefix_cache_queries,
        "runs_per_request": statistics.mean(runs),
        "runs_per_block": sum(runs) / sum(blocks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-blocks", type=int, nargs="+", default=[1024, 2048])
    args = parser.parse_args()
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    if min(args.num_blocks) < 256:
        parser.error("--num-blocks must be >= 256 (8 running requests of up to 113 blocks)")
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.2f}")
    print(
        f"workload: {args.requests} requests, {NUM_PREFIXES} shared prefixes of 128-1536 tokens "
        f"(Zipf s={ZIPF_S}) + 16-256 unique tokens in {SHARED_FRACTION:.0%}, unique 256-1024 "
        f"otherwise; outputs 8-128; block {BLOCK_SIZE}, {MAX_NUM_SEQS} running, seeds {args.seeds}"
    )
    cols = [("KV blocks", 9), ("eviction", 24), ("hit rate (seed range)", 21)]
    cols += [("vs strict", 9), ("runs / request", 14), ("runs / block", 12)]
    print("| " + " | ".join(f"{name:>{w}}" for name, w in cols) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for _, w in cols) + "|")
    for num_blocks in args.num_blocks:
        strict_hit: list[float] = []
        for label, evict_runs in (("strict LRU", False), ("runs (old, never hit)", True)):
            res = [
                simulate(workload(seed, args.requests), num_blocks, evict_runs)
                for seed in args.seeds
            ]
            hit = [r["hit_rate"] * 100 for r in res]
            if not evict_runs:
                strict_hit = hit
            delta = statistics.mean(h - s for h, s in zip(hit, strict_hit))
            cells = [
                num_blocks,
                label,
                f"{statistics.mean(hit):.1f}% ({min(hit):.1f}-{max(hit):.1f})",
                f"{delta:+.1f}" if evict_runs else "",
                f"{statistics.mean(r['runs_per_request'] for r in res):.2f}",
                f"{statistics.mean(r['runs_per_block'] for r in res):.3f}",
            ]
            print("| " + " | ".join(f"{c!s:>{w}}" for c, (_, w) in zip(cells, cols)) + " |")


if __name__ == "__main__":
    main()
