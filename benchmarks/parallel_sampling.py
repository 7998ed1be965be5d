"""Parallel sampling: one request with n=8 (fork) vs 8 independent requests.

Same prompt (random token ids), same seeds (the fork's choice i uses seed + i,
so each independent request i is given seed + i and both runs sample the
same tokens), one in-process engine each run. Reported per mode: the peak
number of KV blocks referenced by requests (cached free blocks not counted),
output tokens per second from submission to the last token, and how many
of the n token streams equal the fork's (they are the same draws; a stream
can still part from the fork's on a near-tie, since the fork computes the
prompt as one chunk of num_tokens - 1 and each request as num_tokens, and
floating point sums depend on the shape).

    python -m benchmarks.parallel_sampling                 # tiny model
    python -m benchmarks.parallel_sampling --model smollm2 --repeats 3

Independent requests are run twice: with the prefix cache (later requests hit
the blocks the first ones published, so they share the prompt's full blocks
too) and without it (every request holds its own copy of the prompt).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import msgspec
import torch

from benchmarks._machine import machine
from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore


def run_once(engine: EngineCore, requests: list[EngineRequest]) -> tuple[int, float, dict]:
    """(peak blocks in use, seconds, tokens per (request id, index))."""
    num_blocks = engine.sched_config.num_kv_blocks
    start_s = time.perf_counter()
    for r in requests:
        err = engine.add_request(r)
        assert err is None, err.error
    peak = 0
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_work():
        for o in engine.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        peak = max(peak, num_blocks - engine.scheduler.kv.num_free_blocks)
    elapsed_s = time.perf_counter() - start_s
    engine.check_integrity()
    return peak, elapsed_s, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--torch-threads", type=int, default=2)
    args = p.parse_args()

    base = EngineConfig.from_flat(
        model=args.model,
        block_size=16,
        num_kv_blocks=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        max_model_len=args.prompt_tokens + args.max_tokens + 16,
        torch_threads=args.torch_threads,
    )
    engines = {
        "prefix cache on": EngineCore(base),
        "prefix cache off": EngineCore(base.replace(enable_prefix_caching=False)),
    }
    vocab = engines["prefix cache on"].model.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1000, ignore_eos=True)
    load_before = os.getloadavg()[0]
    rows: dict[str, list[tuple[int, float]]] = {}
    for rep in range(-1, args.repeats):  # repeat -1 warms every engine up, not reported
        # a fresh prompt per repeat: no run is helped by the previous one's cache
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
        fork_req = [EngineRequest(f"fork-{rep}", prompt, sp, n=args.n)]
        alone = [
            EngineRequest(f"alone-{rep}-{i}", prompt, msgspec.structs.replace(sp, seed=1000 + i))
            for i in range(args.n)
        ]
        ref = None
        for mode, engine, reqs in (
            (f"fork (n={args.n})", engines["prefix cache on"], fork_req),
            (f"{args.n} independent, prefix cache on", engines["prefix cache on"], alone),
            (f"{args.n} independent, prefix cache off", engines["prefix cache off"], alone),
        ):
            engine.scheduler.reset_prefix_cache()
            peak, elapsed_s, tokens = run_once(engine, reqs)
            streams = [
                toks for _, toks in sorted(tokens.items(), key=lambda kv: (kv[0][1], kv[0][0]))
            ]
            if ref is None:
                ref = streams
            same = sum(a == b for a, b in zip(streams, ref, strict=True))
            if rep >= 0:
                rows.setdefault(mode, []).append((peak, elapsed_s, same))
    load_after = os.getloadavg()[0]

    num_out = args.n * args.max_tokens
    print(f"machine: {machine()}; torch threads {args.torch_threads}")
    print(
        f"model {args.model}; prompt {args.prompt_tokens} tokens, n={args.n}, "
        f"{args.max_tokens} output tokens each, block size 16; median of {args.repeats}; "
        f"load average {load_before:.1f} -> {load_after:.1f}\n"
    )
    fork_blocks = statistics.median(r[0] for r in next(iter(rows.values())))
    print(
        "| mode | peak KV blocks | vs fork | output tok/s | spread (min-max tok/s) "
        "| streams equal to the fork's |"
    )
    print("|---|---:|---:|---:|---|---:|")
    for mode, runs in rows.items():
        blocks = statistics.median(r[0] for r in runs)
        rates = [num_out / r[1] for r in runs]
        same = sum(r[2] for r in runs)
        print(
            f"| {mode} | {blocks:.0f} | {blocks / fork_blocks:.2f}x | "
            f"{statistics.median(rates):.0f} | {min(rates):.0f}-{max(rates):.0f} "
            f"| {same}/{args.n * len(runs)} |"
        )


if __name__ == "__main__":
    main()
