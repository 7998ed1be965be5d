"""torch.compile vs eager: compile time and steady-state engine steps (``--compile-model``).

    .venv/bin/python benchmarks/compile_model.py                       # tiny + smollm2, CPU
    .venv/bin/python benchmarks/compile_model.py --models tiny --batches 1,8 --steps 40

For each model, one engine with ``compile_model="off"`` and one with ``"on"``, each in turn:
start-up (compile seconds = the warm-up that compiles both graphs, as the engine logs it), then
``B`` requests of a ``--prompt-len`` prompt until all decode, and ``--steps`` decode steps timed
(scheduler + forward + sampling, the engine's real step) per batch size, the median over
``--rounds`` rounds; then one prefill of ``--prefill-len`` tokens. Greedy tokens of the two
engines are compared. fp32 on CPU, ``torch_threads`` pinned (``--threads``).

``decode_step_ms`` is importable for ``benchmarks/gpu_engine.py`` (its CUDA rows).
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
from scheduler.messages import EngineRequest, SamplingParams  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine_core import EngineCore  # noqa: E402


def _sync(engine: EngineCore) -> None:
    if engine.kv_cache.is_cuda:
        torch.cuda.synchronize(engine.kv_cache.device)


def decode_step_ms(
    engine: EngineCore, batch: int, prompt_len: int, num_steps: int, num_rounds: int
) -> tuple[float, list[list[int]]]:
    """Median ms of one decode step of ``batch`` requests, and their greedy tokens."""
    params = SamplingParams(max_tokens=num_rounds * num_steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = [(7 * i + j) % 97 + 3 for j in range(prompt_len)]
        engine.add_request(EngineRequest(rid, prompt, params))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> None:
        for out in engine.step().outputs:
            if out.request_id in tokens:
                tokens[out.request_id].extend(out.new_token_ids)

    decoding = 0
    while decoding < 2:  # two decode-only steps in a row: every request decodes
        step()
        decoding = decoding + 1 if engine.last_step_num_tokens == batch else 0
    rounds = []
    for _ in range(num_rounds):
        _sync(engine)
        start = time.perf_counter()
        for _ in range(num_steps):
            step()
        _sync(engine)
        rounds.append((time.perf_counter() - start) / num_steps * 1e3)
    engine.abort(ids)
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    return statistics.median(rounds), [tokens[rid][:num_steps] for rid in ids]


def prefill_ms(engine: EngineCore, length: int, num_rounds: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for r in range(num_rounds + 1):
        prompt = [(r * 13 + j * 5) % 89 + 3 for j in range(length)]  # no prefix hit
        engine.add_request(EngineRequest(f"p{r}-{time.monotonic_ns()}", prompt, params))
        _sync(engine)
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        _sync(engine)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])  # the first one warms up


def run(model: str, mode: str, args: argparse.Namespace) -> dict:
    config = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        torch_threads=args.threads,
        max_num_seqs=max(args.batch_list),
        max_num_batched_tokens=max(args.prefill_len, 256),
        enable_prefix_caching=False,
        compile_model=mode,
        kv_cache_memory=256 << 20,
    )
    start = time.perf_counter()
    engine = EngineCore(config)
    result = {
        "startup_s": time.perf_counter() - start,
        "compile_s": engine.compile_report.seconds if engine.compile_report else 0.0,
        "tokens": [],
    }
    for batch in args.batch_list:
        ms, tokens = decode_step_ms(engine, batch, args.prompt_len, args.steps, args.rounds)
        result[f"b{batch}"] = ms
        result["tokens"].append(tokens)
    result["prefill"] = prefill_ms(engine, args.prefill_len, args.rounds)
    engine.shutdown()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="decode steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill-len", type=int, default=256)
    args = p.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    rows = []
    for model in args.models.split(","):
        results = {mode: run(model, mode, args) for mode in ("off", "on")}
        same = results["off"]["tokens"] == results["on"]["tokens"]
        for mode, r in results.items():
            cells = [model, "compiled" if mode == "on" else "eager", f"{r['compile_s']:.1f}"]
            for batch in args.batch_list:
                ms = r[f"b{batch}"]
                cells.append(f"{ms:.2f} ms, {batch / ms * 1e3:.0f} tok/s")
            cells += [f"{r['prefill']:.1f}", "yes" if same else "NO"]
            rows.append(cells)
    print(machine())
    print(
        f"device {args.device}, {args.dtype}, torch {torch.__version__}, torch_threads "
        f"{args.threads}; decode: prompts of {args.prompt_len}, median of {args.rounds} x "
        f"{args.steps} steps; prefill: one prompt of {args.prefill_len} tokens"
    )
    header = ["model", "forward", "compile s"]
    header += [f"decode step, batch {b}" for b in args.batch_list]
    header += [f"prefill {args.prefill_len} ms", "same tokens"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for cells in [header] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(cells, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
