"""Mixed-step time by CUDA graph mode (issue #10): eager vs piecewise vs full + piecewise.

    .venv/bin/python benchmarks/gpu_piecewise.py            # the 1B-shaped model, all shapes
    .venv/bin/python benchmarks/gpu_piecewise.py --quick    # two shapes, fewer steps

One seeded random Llama-3.2-1B-shaped checkpoint (``benchmarks/gpu_engine.py``), bf16. For
each ``--cuda-graph-mode`` one engine: ``decode`` (mixed steps eager: today's default),
``piecewise`` and ``full_and_piecewise``. A shape ``D+C`` is D sequences decoding (prompt
``--prompt-len``) while long prompts are prefilled C tokens a step: every timed step has
D + C tokens (``last_step_num_tokens`` is checked), and its wall time includes scheduling,
the forward, sampling and the one device sync. ``D+0`` is a decode-only step. Also printed
per mode: the start-up capture seconds and graph memory, and the profiled activation peak.

Which mode is faster decides the default (``workers/graphs/sizes.py``: ``decode`` until
measured). Without CUDA it prints that there is no GPU and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_engine import (  # noqa: E402
    ONE_B_CONFIG,
    _release,
    make_1b_checkpoint,
    no_gpu_message,
)

MODES = ("decode", "piecewise", "full_and_piecewise")


def _shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        decodes, chunk = part.split("+")
        shapes.append((int(decodes), int(chunk)))
    return shapes


def _prompt(n: int, seed: int, vocab_size: int = ONE_B_CONFIG["vocab_size"]) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


def _engine(path: str, mode: str, shapes: list[tuple[int, int]], args) -> object:
    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.core import EngineCore

    return EngineCore(
        EngineConfig.from_flat(
            model=path,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=max(d for d, _ in shapes) + 1,
            max_num_batched_tokens=max(d + c for d, c in shapes),
            enable_prefix_caching=False,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cuda_graph_mode=mode,
        )
    )


def _sync(engine) -> None:
    if engine.config.model.device.startswith("cuda"):
        torch.cuda.synchronize()


def step_ms(engine, decodes: int, chunk: int, args) -> float:
    """Mean wall ms of ``args.steps`` steps of ``decodes`` decodes + a ``chunk``-token chunk."""
    from tandem.wire.engine_protocol import EngineRequest, SamplingParams

    num_steps = args.steps
    # One engine serves every shape, its budget the largest D + C: a step must not fill the
    # rest of the budget with prompt tokens. The decodes' prompts prefill uncapped; then one
    # partial prefill of at most C tokens a step (the scheduler's partial-prefill limits).
    sched = engine.scheduler.config
    sched.long_prefill_token_threshold, sched.max_num_partial_prefills = 0, 0
    # The first prompts decode while the last still prefill: every decode must outlive all
    # the prompts' prefill steps, the settling and the timed steps (a shorter max_tokens let
    # the first decodes finish before the last began, and the loop below never settled).
    budget = engine.scheduler.config.max_num_batched_tokens
    prefill_steps = math.ceil(decodes * args.prompt_len / budget)
    params = SamplingParams(
        max_tokens=prefill_steps + num_steps * 2 + 64, temperature=0.0, ignore_eos=True
    )
    ids = [f"d{decodes}-{chunk}-{i}" for i in range(decodes)]
    for i, rid in enumerate(ids):
        engine.add_request(
            EngineRequest(rid, _prompt(args.prompt_len, i, engine.model.vocab_size), params)
        )
    settled, steps_left = 0, prefill_steps + 64
    while decodes and settled < 3:  # every sequence decodes
        if steps_left == 0:
            raise RuntimeError(f"{decodes} decodes never ran together in one step")
        engine.step()
        steps_left -= 1
        settled = settled + 1 if engine.last_step_num_tokens == decodes else 0
    if chunk:
        # prompts of a whole number of chunks, one after another (max_num_seqs = D + 1): every
        # step prefills exactly `chunk` tokens, the last chunk of one prompt included
        per_prompt = chunk * max(1, (engine.max_model_len - 1) // chunk)
        long_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        sched.long_prefill_token_threshold, sched.max_num_partial_prefills = chunk, 1
        for j in range(math.ceil((num_steps + 2) * chunk / per_prompt) + 1):
            ids.append(f"long{j}")
            engine.add_request(
                EngineRequest(
                    ids[-1], _prompt(per_prompt, 100 + j, engine.model.vocab_size), long_params
                )
            )
        for _ in range(2):  # warm: the first chunk steps
            engine.step()
    _sync(engine)
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
        if engine.last_step_num_tokens != decodes + chunk:
            raise RuntimeError(
                f"step had {engine.last_step_num_tokens} tokens, not {decodes}+{chunk}"
            )
    _sync(engine)
    elapsed_ms = (time.perf_counter() - start) / num_steps * 1e3
    engine.abort(ids)
    sched.long_prefill_token_threshold, sched.max_num_partial_prefills = 0, 0
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    return elapsed_ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shapes 8+56,64+192; 10 steps")
    p.add_argument("--shapes", default="1+15,8+56,32+96,64+192,128+384,64+0")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = p.parse_args()
    message = no_gpu_message()
    if message is not None:
        print(message.replace("gpu_engine", "gpu_piecewise"))
        return 0
    if args.quick:
        args.shapes, args.steps = "8+56,64+192", 10
    shapes = _shapes(args.shapes)
    ms: dict[str, list[float]] = {}
    startup: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-gpu-pw-") as tmp_dir:
        path = make_1b_checkpoint(tmp_dir)
        for mode in MODES:
            built = time.perf_counter()
            engine = _engine(path, mode, shapes, args)
            built_s = time.perf_counter() - built
            graphs, mem = engine.graphs, engine.step_memory
            startup[mode] = (
                f"start {built_s:.1f} s, capture {graphs.seconds:.1f} s, graphs "
                f"{graphs.num_bytes / 2**20:.0f} MiB (profiled {mem.graph_bytes / 2**20:.0f}), "
                f"activations {mem.activation_bytes / 2**20:.0f} MiB, "
                f"profiling {mem.seconds:.1f} s"
            )
            print(f"{mode}: {startup[mode]}", flush=True)  # as measured: a cut run keeps rows
            ms[mode] = []
            for d, c in shapes:
                ms[mode].append(step_ms(engine, d, c, args))
                print(f"  {mode} {d}+{c}: {ms[mode][-1]:.2f} ms/step", flush=True)
            # every reference to the engine's CUDA memory goes before the next engine sizes
            # its KV cache from what is free (on 2026-11-27 the first engine's graphs, held
            # by ``graphs``, left the second a negative budget)
            engine.shutdown()
            del engine, graphs, mem
            _release()
            left = torch.cuda.memory_allocated() / 2**20
            print(f"  after {mode}: {left:.0f} MiB still allocated", flush=True)

    gpu = torch.cuda.get_device_name()
    print(f"GPU:      {gpu}; {datetime.date.today().isoformat()}; torch {torch.__version__}")
    print(
        f"workload: random Llama-3.2-1B shape, bf16; D decodes (prompt {args.prompt_len}) + "
        f"a C-token prefill chunk per step; {args.steps} timed steps; ms per step"
    )
    print(
        f"{'D+C':>8}  {'tokens':>6}  " + "  ".join(f"{m:>18}" for m in MODES) + "  piecewise/eager"
    )
    for i, (d, c) in enumerate(shapes):
        row = "  ".join(f"{ms[m][i]:>15.2f} ms" for m in MODES)
        ratio = ms["decode"][i] / ms["piecewise"][i]
        print(f"{f'{d}+{c}':>8}  {d + c:>6}  {row}  {ratio:.2f}x")
    for mode in MODES:
        print(f"{mode}: {startup[mode]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
