"""Speculation at batch 1 on the copy workload, in step counts and step costs (issue #26).

    PYTHONPATH=$(python3 benchmarks/checkout.py $PWD) \\
        .venv/bin/python benchmarks/spec_step_cost.py --prompts 32 --output-len 48

``benchmarks/spec_decode.py`` times whole rows, and its batch-1 copy row serves one prompt
(the first); on a shared box its ratios move by 10-20% between runs. This script splits
the question in two parts that do not depend on the box's load as much:

lookup     smollm2's greedy outputs (fp32, EOS ignored) for the first ``--prompts`` copy
           prompts of spec_decode.py, then prompt lookup (``prompt_lookup_min`` 2, max 4,
           as spec_decode.py configures it) replayed over each output with a fixed cap K
           (no adaptive policy): the steps the request needs, how many carry a draft, the
           share of drafted tokens kept. Greedy verification keeps exactly the drafts that
           equal the output, so these counts are what the engine would see at that cap.
step cost  the median CPU time of a batch-1 step that verifies ``1 + d`` tokens (a copy
           prompt the model repeats, the proposer's cap fixed at d), against a plain
           one-token step, with the LM head's few-row path (``workers/models/layers.
           lm_head_logits``) on and off, interleaved. Every row's tokens equal the plain
           row's (checked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from benchmarks.spec_decode import copy_prompts, encode  # noqa: E402
from tandem.scheduler.spec.config import SpeculativeConfig  # noqa: E402
from tandem.scheduler.spec.lookahead import Lookahead  # noqa: E402
from tandem.scheduler.spec.proposer import NgramProposer  # noqa: E402
from tandem.wire.engine_protocol import EngineRequest, SamplingParams  # noqa: E402
from tandem.workers.config import EngineConfig  # noqa: E402
from tandem.workers.engine.core import EngineCore  # noqa: E402
from tandem.workers.models import layers  # noqa: E402
from tandem.workers.text.tokenizer import load_tokenizer  # noqa: E402


def replay(proposer: NgramProposer, prompt: list[int], out: list[int], k: int):
    """(steps, steps with drafts, drafts kept, drafts made) to decode ``out[1:]``."""
    t = 1
    steps = drafted = kept = made = 0
    while t < len(out):
        drafts = proposer.propose(prompt + out[:t], k)
        run = 0
        for d, o in zip(drafts, out[t:]):
            if d != o:
                break
            run += 1
        steps += 1
        drafted += bool(drafts)
        kept += run
        made += len(drafts)
        t += run + 1
    return steps, drafted, kept, made


def generate(engine: EngineCore, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    engine.scheduler.spec = None
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert engine.add_request(EngineRequest(f"g{i}", p, sp)) is None
    outs: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step().outputs:
            outs[o.request_id].extend(o.new_token_ids)
    engine.check_integrity()
    return list(outs.values())


def lookup_table(engine, prompts, output_len: int, ks: list[int]) -> None:
    outs = generate(engine, prompts, output_len)
    proposer = NgramProposer(SpeculativeConfig("ngram", max(ks), 2, 4))
    print(f"lookup: {len(prompts)} copy prompts, {output_len} tokens each (steps for the")
    print("tokens after the first; a plain engine needs one step per token)\n")
    print(f"{'prompt':>6} {'tokens':>6}  " + "  ".join(f"{'K=' + str(k):>22}" for k in ks))
    totals = {k: [0, 0, 0, 0] for k in ks}
    for i, (p, out) in enumerate(zip(prompts, outs)):
        cells = []
        for k in ks:
            r = replay(proposer, p, out, k)
            totals[k] = [a + b for a, b in zip(totals[k], r)]
            cells.append(f"{r[0]:>3} steps {r[1]:>3} drafted")
        print(f"{i:>6} {len(out) - 1:>6}  " + "  ".join(f"{c:>22}" for c in cells))
    tokens = sum(len(o) - 1 for o in outs)
    for k in ks:
        steps, drafted, kept, made = totals[k]
        print(
            f"K={k}: {tokens} tokens in {steps} steps ({tokens / steps:.2f} tokens a step), "
            f"{drafted} steps drafted, {kept / max(made, 1):.2f} of drafts kept"
        )
    print()


def step_cost_table(engine, prompt: list[int], caps: list[int], repeats: int) -> None:
    kv = engine.scheduler.kv
    seconds: dict[tuple[int, int], list[float]] = {}
    tokens: dict[tuple[int, int], list[int]] = {}
    run = 0
    saved = layers.SMALL_LOGITS_ROWS
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for _ in range(repeats):
        for d in [0, *caps]:
            for small in (0, saved):
                layers.SMALL_LOGITS_ROWS = small
                spec = None
                if d:
                    spec = Lookahead(SpeculativeConfig("ngram", d, 2, 4), kv)
                    spec.policy.cap = lambda req, d=d: d
                engine.scheduler.spec = spec
                run += 1
                assert engine.add_request(EngineRequest(f"c{run}", prompt, sp)) is None
                out: list[int] = []
                times: list[float] = []
                while engine.has_work():
                    start = time.process_time()
                    outs = engine.step().outputs
                    times.append(time.process_time() - start)
                    for o in outs:
                        out.extend(o.new_token_ids)
                engine.check_integrity()
                seconds.setdefault((d, small), []).extend(times[2:])  # past prefill, fill
                tokens[(d, small)] = out
    layers.SMALL_LOGITS_ROWS = saved
    plain = {s: statistics.median(seconds[(0, s)]) for s in (0, saved)}
    print(f"step cost: batch 1, CPU ms of a step (median of {repeats} rows each), x plain step")
    print(f"{'tokens':>6}  {'F.linear head':>18}  {'W @ x.T head':>18}  same")
    for d in [0, *caps]:
        cells = []
        for s in (0, saved):
            m = statistics.median(seconds[(d, s)])
            cells.append(f"{m * 1e3:8.1f} ms {m / plain[s]:5.2f}x")
        same = all(tokens[(d, s)] == tokens[(0, 0)] for s in (0, saved))
        print(f"{1 + d:>6}  {cells[0]:>18}  {cells[1]:>18}  {'yes' if same else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--caps", default="1,2,4,8", help="step cost: drafts per step")
    ap.add_argument("--cost-prompt", type=int, default=1, help="step cost: copy prompt index")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--skip", choices=("lookup", "cost"), default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    engine = EngineCore(
        EngineConfig.from_flat(
            model="smollm2",
            dtype="float32",
            max_model_len=1024,
            num_kv_blocks=4096,
            max_num_batched_tokens=4096,
            max_num_seqs=64,
            torch_threads=args.torch_threads,
        )
    )
    tokenizer = load_tokenizer(engine.model_path)
    texts = copy_prompts(max(args.prompts, args.cost_prompt + 1))
    prompts = [encode(tokenizer, t) for t in texts]
    print(f"machine: {machine()}; torch threads {args.torch_threads}; smollm2 fp32 CPU, greedy\n")
    if args.skip != "lookup":
        ks = [int(k) for k in args.ks.split(",")]
        lookup_table(engine, prompts[: args.prompts], args.output_len, ks)
    if args.skip != "cost":
        caps = [int(c) for c in args.caps.split(",")]
        step_cost_table(engine, prompts[args.cost_prompt], caps, args.repeats)
    engine.shutdown()


if __name__ == "__main__":
    main()
