"""Synchronous vs overlapped engine loop (``--async-scheduling``) on this machine.

    .venv/bin/python benchmarks/async_scheduling.py                      # tiny + smollm2
    .venv/bin/python benchmarks/async_scheduling.py --models tiny --batches 1,32

For every model, decode batch and loop: ``batch`` seeded random prompts of ``--prompt-len``
tokens generate exactly ``--output-len`` tokens each (greedy, EOS ignored, prefix caching
off; fp32 on the CPU unless ``--device cuda`` / ``--dtype`` say otherwise) after a warm-up
run with the same engine. Columns:

    step ms    mean wall time of one loop turn while every request decodes (a turn is one
               step: the synchronous loop runs it; the overlapped loop schedules and launches
               step N+1, then reads step N's tokens and applies them)
    host ms    synchronous loop: mean time per decode step outside the forward and the token
               read (schedule, plan, update): the most overlapping can hide. (Not shown for
               the overlapped loop: there the loop thread's work is interleaved with the
               forward's Python under the GIL, so the same subtraction measures nothing.)
    tok/s      output tokens per second of the whole run (prefill included)
    same       every run's tokens equal the synchronous loop's first run

Both loops get their own engine; after one warm-up run each, ``--repeats`` timed runs
alternate between them and every column is the median over those runs (the machine's other
load shifts both alike).

Models: ``tiny`` (the built-in checkpoint) and ``smollm2`` (SmolLM2-135M-Instruct from the
built-in GGUF, 30 layers). ``--torch-threads`` is the engine's intra-op thread count; the
overlapped loop's step thread uses the same count, its loop thread is one more.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from benchmarks.offline_throughput import make_prompts, model_path  # noqa: E402

SEED = 0


class _Timed:
    """Wraps a runner method; adds its wall time to ``seconds`` when called on the loop
    thread (the synchronous loop's inline forward, either loop's wait for tokens)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.loop_thread = threading.get_ident()
        self.seconds = 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            if threading.get_ident() == self.loop_thread:
                self.seconds += time.perf_counter() - start


class Bench:
    """One engine (one loop) and its timed runs."""

    def __init__(self, path: str, batch: int, prompt_len: int, output_len: int, overlap: bool,
                 args: argparse.Namespace) -> None:  # fmt: skip
        from tandem.workers.config import EngineConfig
        from tandem.workers.engine.core import EngineCore

        self.engine = EngineCore(
            EngineConfig.from_flat(
                model=path,
                device=args.device,
                dtype=args.dtype,
                max_num_seqs=batch,
                max_num_batched_tokens=max(2048, batch),
                num_kv_blocks=batch * -(-(prompt_len + output_len) // 16) + 16,
                enable_prefix_caching=False,
                torch_threads=args.torch_threads,
                async_scheduling=overlap,
            )
        )
        runner = self.engine.runner
        self.timers = [_Timed(runner.read_tokens), _Timed(runner._run_step)]
        runner.read_tokens, runner._run_step = self.timers
        self.batch, self.output_len = batch, output_len
        self.num_runs = 0

    def run(self, prompts: list[list[int]]) -> tuple[list[list[int]], float, float, float]:
        """(tokens, mean decode turn s, mean loop-thread host s per decode turn, total s)."""
        from tandem.wire.engine_protocol import EngineRequest, SamplingParams

        engine, batch = self.engine, self.batch
        sp = SamplingParams(max_tokens=self.output_len, temperature=0.0, ignore_eos=True)
        self.num_runs += 1
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            rid = f"{self.num_runs}-{i}"
            tokens[rid] = []
            engine.add_request(EngineRequest(rid, prompt, sp))
        step_s, host_s = [], []
        start = time.perf_counter()
        while engine.has_work():
            for t in self.timers:
                t.seconds = 0.0
            t0 = time.perf_counter()
            out = engine.step()
            dt = time.perf_counter() - t0
            decoding = engine.last_step_num_tokens == batch and all(tokens.values())
            for o in out.outputs:
                tokens[o.request_id] += o.new_token_ids
            if decoding and len(out.outputs) == batch:
                step_s.append(dt)
                host_s.append(dt - sum(t.seconds for t in self.timers))
        total_s = time.perf_counter() - start
        mean = statistics.fmean
        return list(tokens.values()), mean(step_s), mean(host_s), total_s

    def close(self) -> None:
        self.engine.check_integrity()
        self.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the same table on a GPU")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per loop, alternated")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("async_scheduling: no GPU (torch.cuda.is_available() is False); nothing measured")
        return
    import logging

    logging.basicConfig(level=logging.WARNING)
    load = os.getloadavg()
    gpu = f"; GPU {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""
    print(f"machine: {machine()}{gpu}; torch {torch.__version__}; load average {load[0]:.2f}")
    print(
        f"workload: batch x {args.prompt_len} prompt tokens -> {args.output_len} greedy tokens, "
        f"{args.dtype}, {args.device}, torch threads {args.torch_threads}\n"
    )
    header = (
        f"{'model':<8} {'batch':>5} {'loop':<6} {'step ms':>8} {'host ms':>8} "
        f"{'tok/s':>8} {'same':>5}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        path = model_path(name, "/tmp")
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(path).vocab_size
        for batch in map(int, args.batches.split(",")):
            prompts = make_prompts(batch, args.prompt_len, vocab)
            benches = {
                overlap: Bench(path, batch, args.prompt_len, args.output_len, overlap, args)
                for overlap in (False, True)
            }  # fmt: skip
            runs: dict[bool, list] = {False: [], True: []}
            for rep in range(args.repeats + 1):  # the first round warms up
                for overlap, bench in benches.items():
                    result = bench.run(prompts)
                    if rep:
                        runs[overlap].append(result)
            for bench in benches.values():
                bench.close()
            reference = runs[False][0][0]
            for overlap in (False, True):
                results = runs[overlap]
                same = all(r[0] == reference for r in results)
                step_ms = 1e3 * statistics.median(r[1] for r in results)
                host_ms = 1e3 * statistics.median(r[2] for r in results)
                tok_s = batch * args.output_len / statistics.median(r[3] for r in results)
                print(
                    f"{name:<8} {batch:>5} {'async' if overlap else 'sync':<6} "
                    f"{step_ms:>8.2f} {'-' if overlap else f'{host_ms:.2f}':>8} "
                    f"{tok_s:>8.0f} {'yes' if same else 'NO':>5}",
                    flush=True,
                )
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
