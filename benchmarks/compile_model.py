"""torch.compile vs eager: compile time and steady-state engine steps (``--compile-model``).

    .venv/bin/python benchmarks/compile_model.py                       # tiny + smollm2, CPU
    .venv/bin/python benchmarks/compile_model.py --models tiny --batches 1,8 --steps 40

For each model, one engine with ``compile_model="off"`` and one with ``"on"`` (compile seconds =
the start-up warm-up that compiles both graphs, as the engine logs it), side by side: ``B``
requests of a ``--prompt-len`` prompt until all decode, then ``--rounds`` rounds of ``--steps``
decode steps (scheduler + forward + sampling, the engine's real step), the two engines' rounds
interleaved so load drifts hit both; the median round per batch size; then prefills of
``--prefill-len`` tokens, interleaved too. Greedy tokens of the two engines are compared. fp32
on CPU, ``torch_threads`` pinned (``--threads``).

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
from tandem.wire.engine_protocol import EngineRequest, SamplingParams  # noqa: E402
from tandem.workers.config import EngineConfig  # noqa: E402
from tandem.workers.engine.core import EngineCore  # noqa: E402


def _sync(engine: EngineCore) -> None:
    if engine.kv_cache.is_cuda:
        torch.cuda.synchronize(engine.kv_cache.device)


class DecodeRun:
    """``batch`` requests of one engine brought to steady decoding; ``round`` times steps."""

    def __init__(self, engine: EngineCore, batch: int, prompt_len: int, max_steps: int) -> None:
        self.engine, self.batch = engine, batch
        params = SamplingParams(max_tokens=max_steps + 8, temperature=0.0, ignore_eos=True)
        self.ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
        for i, rid in enumerate(self.ids):
            prompt = [(7 * i + j) % 97 + 3 for j in range(prompt_len)]
            engine.add_request(EngineRequest(rid, prompt, params))
        self.tokens: dict[str, list[int]] = {rid: [] for rid in self.ids}
        decoding = 0
        while decoding < 2:  # two decode-only steps in a row: every request decodes
            self._step()
            decoding = decoding + 1 if engine.last_step_num_tokens == batch else 0

    def _step(self) -> None:
        for out in self.engine.step().outputs:
            if out.request_id in self.tokens:
                self.tokens[out.request_id].extend(out.new_token_ids)

    def round(self, num_steps: int) -> float:
        """Mean ms of ``num_steps`` decode steps."""
        _sync(self.engine)
        start = time.perf_counter()
        for _ in range(num_steps):
            self._step()
        _sync(self.engine)
        return (time.perf_counter() - start) / num_steps * 1e3

    def finish(self, num_tokens: int) -> list[list[int]]:
        """Abort the requests; each one's first ``num_tokens`` greedy tokens."""
        self.engine.abort(self.ids)
        while self.engine.has_work():
            self.engine.step()
        self.engine.check_integrity()
        return [self.tokens[rid][:num_tokens] for rid in self.ids]


def decode_step_ms(
    engine: EngineCore, batch: int, prompt_len: int, num_steps: int, num_rounds: int
) -> tuple[float, list[list[int]]]:
    """Median ms of one decode step of ``batch`` requests, and their greedy tokens."""
    run = DecodeRun(engine, batch, prompt_len, num_rounds * num_steps)
    ms = statistics.median(run.round(num_steps) for _ in range(num_rounds))
    return ms, run.finish(num_steps)


def prefill_once_ms(engine: EngineCore, length: int, salt: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = [(salt * 13 + j * 5) % 89 + 3 for j in range(length)]  # no prefix cache anyway
    engine.add_request(EngineRequest(f"p{salt}-{time.monotonic_ns()}", prompt, params))
    _sync(engine)
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    _sync(engine)
    return (time.perf_counter() - start) * 1e3


def prefill_ms(engine: EngineCore, length: int, num_rounds: int) -> float:
    """Median ms of a prefill of ``length`` tokens (after one warm-up)."""
    prefill_once_ms(engine, length, 0)
    return statistics.median(prefill_once_ms(engine, length, r + 1) for r in range(num_rounds))


def make_engine(model: str, mode: str, args: argparse.Namespace) -> EngineCore:
    config = EngineConfig.from_flat(
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
    return EngineCore(config)


def compare(model: str, args: argparse.Namespace) -> list[list[str]]:
    """Eager and compiled engines side by side, their rounds interleaved (the machine's load
    drifts: each round of one is next to a round of the other)."""
    engines = {mode: make_engine(model, mode, args) for mode in ("off", "on")}
    results: dict[str, dict] = {mode: {} for mode in engines}
    same = True
    for batch in args.batch_list:
        runs = {mode: DecodeRun(e, batch, args.prompt_len, args.rounds * args.steps) for mode, e in engines.items()}  # fmt: skip
        times: dict[str, list[float]] = {mode: [] for mode in engines}
        for _ in range(args.rounds):
            for mode, run in runs.items():
                times[mode].append(run.round(args.steps))
        tokens = {mode: run.finish(args.steps) for mode, run in runs.items()}
        same = same and tokens["off"] == tokens["on"]
        for mode in engines:
            results[mode][batch] = statistics.median(times[mode])
    prefill: dict[str, list[float]] = {mode: [] for mode in engines}
    for engine in engines.values():
        prefill_once_ms(engine, args.prefill_len, 0)  # warm-up
    for r in range(args.rounds):
        for mode, engine in engines.items():
            prefill[mode].append(prefill_once_ms(engine, args.prefill_len, r + 1))
    rows = []
    for mode, engine in engines.items():
        report = engine.compile_report
        cells = [model, "compiled" if mode == "on" else "eager"]
        cells.append(f"{report.seconds:.1f}" if report else "-")
        for batch in args.batch_list:
            ms = results[mode][batch]
            cells.append(f"{ms:.2f} ms, {batch / ms * 1e3:.0f} tok/s")
        cells += [f"{statistics.median(prefill[mode]):.1f}", "yes" if same else "NO"]
        rows.append(cells)
        engine.shutdown()
    return rows


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
        rows += compare(model, args)
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
