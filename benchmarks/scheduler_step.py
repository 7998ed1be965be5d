"""Scheduler hot path: microseconds per schedule() + update_from_output() step.

A fake model runner returns one token per request whose chunk reached the end
of its tokens; only the scheduler's own time is measured. Prefix caching on,
block size 16, distinct random prompts, EOS ignored, all requests admitted
at once. Run: python benchmarks/scheduler_step.py [--hash-algo sha256|xxhash128|builtin]
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
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402
from scheduler.block_hash import HASH_ALGOS  # noqa: E402
from scheduler.messages import ModelRunnerOutput  # noqa: E402

WORKLOADS = [(64, 128, 128), (256, 128, 128), (1024, 32, 64)]
BLOCK_SIZE = 16


def fake_execute(so, lens: dict[str, list[int]]) -> ModelRunnerOutput:
    """lens[rid] = [num_computed, num_tokens]; returns token 7 when a chunk ends."""
    out = ModelRunnerOutput()
    req_ids, sampled = out.req_ids, out.sampled_token_ids
    for nr in so.scheduled_new_reqs:
        lens[nr.req_id] = [nr.num_computed_tokens, len(nr.all_token_ids)]
    for rid in so.finished_req_ids:
        lens.pop(rid, None)
    for rid, n in so.num_scheduled_tokens.items():
        st = lens[rid]
        st[0] += n
        req_ids.append(rid)
        if st[0] == st[1]:
            st[1] += 1
            sampled.append([7])
        else:
            sampled.append([])
    return out


def run(
    num_reqs: int, prompt_len: int, output_len: int, hash_algo: str = "sha256", seed: int = 0
) -> dict:
    rng = random.Random(seed)
    max_len = prompt_len + output_len
    cfg = SchedulerConfig(
        num_kv_blocks=num_reqs * (-(-max_len // BLOCK_SIZE)) + 16,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=8192,
        max_num_seqs=num_reqs,
        max_model_len=max(max_len + 1, 2048),
        enable_prefix_caching=True,
        prefix_caching_hash_algo=hash_algo,
    )
    s = Scheduler(cfg)
    for i in range(num_reqs):
        s.add_request(
            Request(
                f"r{i}",
                [rng.randrange(32000) for _ in range(prompt_len)],
                SamplingParams(max_tokens=output_len, ignore_eos=True),
            )
        )
    lens: dict[str, list[int]] = {}
    step_us, tokens = [], []
    while s.has_work():
        t0 = time.perf_counter()
        so = s.schedule()
        t1 = time.perf_counter()
        out = fake_execute(so, lens)
        t2 = time.perf_counter()
        s.update_from_output(so, out)
        t3 = time.perf_counter()
        step_us.append(((t1 - t0) + (t3 - t2)) * 1e6)
        tokens.append(so.total_num_scheduled_tokens)
    s.check_integrity()
    # steady decode steps: every request running, one token each
    decode = [us for us, n in zip(step_us, tokens) if n == num_reqs]
    return {
        "steps": len(step_us),
        "mean_us": statistics.mean(step_us),
        "median_us": statistics.median(step_us),
        "decode_median_us": statistics.median(decode) if decode else float("nan"),
        "us_per_token": sum(step_us) / sum(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hash-algo", default="sha256", choices=HASH_ALGOS)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(
        "workload: distinct random prompts, prefix caching on, block 16, budget 8192, "
        f"EOS ignored, block hash {args.hash_algo}"
    )
    hdr = (
        f"| {'reqs':>5} | {'prompt':>6} | {'output':>6} | {'steps':>5} | {'mean us/step':>12} "
        f"| {'median us/step':>14} | {'decode median us/step':>21} | {'us/token':>8} |"
    )
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for n, p, o in WORKLOADS:
        r = run(n, p, o, args.hash_algo)
        print(
            f"| {n:>5} | {p:>6} | {o:>6} | {r['steps']:>5} | {r['mean_us']:>12.0f} "
            f"| {r['median_us']:>14.0f} | {r['decode_median_us']:>21.0f} | {r['us_per_token']:>8.2f} |"
        )


if __name__ == "__main__":
    main()
