"""Preemptions with and without ``--kv-admission-margin`` under a load that fills the cache.

Every request arrives at once; their prompts fit in the KV cache but their
outputs do not, so decodes run out of blocks and the scheduler preempts
(a preempted request recomputes its prompt and outputs later). The margin
keeps a fraction of the blocks free at admission, so fewer requests start
than would fill the cache and the running ones can grow.

    python -m benchmarks.admission_margin
    python -m benchmarks.admission_margin --margins 0 0.1 0.2 --num-requests 48
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks._machine import machine
from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore


def run(args: argparse.Namespace, margin: float) -> dict:
    engine = EngineCore(
        EngineConfig.from_flat(
            model=args.model,
            block_size=16,
            num_kv_blocks=args.num_kv_blocks,
            max_num_batched_tokens=2048,
            max_num_seqs=256,
            max_model_len=args.prompt_tokens + args.max_tokens + 16,
            kv_admission_margin=margin,
            torch_threads=args.torch_threads,
        )
    )
    vocab = engine.model.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start_s = time.perf_counter()
    for i in range(args.num_requests):
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
        assert engine.add_request(EngineRequest(f"r{i}", prompt, sp)) is None
    num_steps = 0
    num_out = 0
    while engine.has_work():
        num_steps += 1
        num_out += sum(len(o.new_token_ids) for o in engine.step().outputs)
    elapsed_s = time.perf_counter() - start_s
    engine.check_integrity()
    stats = engine.scheduler.make_stats()
    assert num_out == args.num_requests * args.max_tokens
    return {
        "preemptions": stats.num_preemptions,
        "steps": num_steps,
        "computed_prompt_tokens": stats.num_prompt_tokens,
        "tok_s": num_out / elapsed_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=192)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--margins", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3])
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs per margin; tok/s is the median")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    results = []
    for m in args.margins:
        runs = [run(args, m) for _ in range(args.repeats)]
        rates = sorted(r["tok_s"] for r in runs)
        results.append((m, dict(runs[0], tok_s=statistics.median(rates), spread=rates)))
    print(f"machine: {machine()}; torch threads {args.torch_threads}")
    print(
        f"model {args.model}; {args.num_requests} requests at once, prompt {args.prompt_tokens} "
        f"+ {args.max_tokens} greedy output tokens each; {args.num_kv_blocks} KV blocks of 16 "
        f"({args.num_kv_blocks * 16} tokens; all requests need "
        f"{args.num_requests * (args.prompt_tokens + args.max_tokens)}); "
        f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| kv_admission_margin | preemptions | engine steps | prompt tokens computed "
        "| output tok/s (median) | spread |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    for m, r in results:
        print(
            f"| {m:g} | {r['preemptions']} | {r['steps']} | {r['computed_prompt_tokens']} | "
            f"{r['tok_s']:.0f} | {r['spread'][0]:.0f}-{r['spread'][-1]:.0f} |"
        )


if __name__ == "__main__":
    main()
