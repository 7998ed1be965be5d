"""Scheduler hot path: microseconds per schedule() + update_from_output() step.

A fake model runner returns one token per request whose chunk reached the end
of its tokens; only the scheduler's own time is measured. Prefix caching on,
block size 16, distinct random prompts, EOS ignored, all requests admitted
at once. "x vLLM" divides the decode median by vLLM 0.33's step time on the
same workload (VLLM_STEP_US). Run:
python benchmarks/scheduler_step.py [--hash-algo sha256|xxhash128|builtin] [--repeat 5]
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
from tandem.scheduler import Request, Scheduler, SchedulerConfig  # noqa: E402
from tandem.scheduler.block_hash import HASH_ALGOS  # noqa: E402
from tandem.scheduler.messages import ModelRunnerOutput  # noqa: E402
from tandem.wire.engine_protocol import SamplingParams  # noqa: E402

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


# vLLM 0.33's v1 scheduler on this machine kind, same workload, sha256 block
# hashes, µs per step with every request running (issue 11's measurement).
VLLM_STEP_US = {64: 725.0, 256: 3400.0, 1024: 15000.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hash-algo", default="sha256", choices=HASH_ALGOS)
    parser.add_argument(
        "--repeat", type=int, default=5, help="runs per workload; the table shows their median"
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.2f}")
    print(
        "workload: distinct random prompts, prefix caching on, block 16, budget 8192, "
        f"EOS ignored, block hash {args.hash_algo}, median of {args.repeat} runs"
    )
    cols = [
        ("reqs", 5),
        ("prompt", 6),
        ("output", 6),
        ("steps", 5),
        ("mean us/step", 12),
        ("median us/step", 14),
        ("decode median us/step", 21),
        ("decode range", 12),
        ("x vLLM", 6),
        ("us/token", 8),
    ]
    print("| " + " | ".join(f"{name:>{w}}" for name, w in cols) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for _, w in cols) + "|")
    for n, p, o in WORKLOADS:
        runs = [run(n, p, o, args.hash_algo) for _ in range(args.repeat)]

        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        decode = [r["decode_median_us"] for r in runs]
        cells = [
            n,
            p,
            o,
            runs[0]["steps"],
            f"{med('mean_us'):.0f}",
            f"{med('median_us'):.0f}",
            f"{med('decode_median_us'):.0f}",
            f"{min(decode):.0f}-{max(decode):.0f}",
            f"{med('decode_median_us') / VLLM_STEP_US[n]:.3f}",
            f"{med('us_per_token'):.2f}",
        ]
        print("| " + " | ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols)) + " |")


if __name__ == "__main__":
    main()
