"""The engine part of ``benchmarks/structured_outputs.py``: what constraining costs a step.

One in-process ``EngineCore`` per model (synchronous loop, greedy, ``ignore_eos``). For each
batch size and constrained share, the batch is admitted and prefilled, then ``steps`` decode
steps are timed. Constrained requests follow a JSON schema that cannot end within the run (an
array of at least 5,000 integers), so every one of them masks on every step. Reported: the median
decode step, the bitmask fill per step (``StructuredOutputManager``'s mask histogram, the
scheduler's share), and the output tokens per second over the timed steps.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks._machine import machine
from tandem.wire.engine_protocol import EngineRequest, SamplingParams, StructuredOutputsParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore

ENDLESS = StructuredOutputsParams(
    "json", json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 5000})
)
SHARES = (("none", 0.0), ("half", 0.5), ("all", 1.0))
PROMPT_LEN = 16


def _mask_totals(engine: EngineCore) -> tuple[int, float]:
    snap = engine.structured.make_stats().mask_seconds
    return snap.count, snap.sum


def run(engine: EngineCore, batch: int, share: float, steps: int, tag: str) -> dict:
    num_constrained = round(batch * share)
    for i in range(batch):
        sp = SamplingParams(
            max_tokens=steps + 4,
            temperature=0.0,
            ignore_eos=True,
            structured_outputs=ENDLESS if i < num_constrained else None,
        )
        prompt = [(7 * i + j) % 200 + 10 for j in range(PROMPT_LEN)]
        err = engine.add_request(EngineRequest(f"{tag}-{i}", prompt, sp))
        assert err is None, err.error
    # admit and prefill (and wait for the grammar: compiled once, then cached)
    while (
        engine.scheduler.waiting
        or engine.scheduler.waiting_for_fsm
        or any(r.num_output_tokens == 0 for r in engine.scheduler.running)
    ):
        engine.step()
    mask_count, mask_sum = _mask_totals(engine)
    times, num_tokens = [], 0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        out = engine.step()
        times.append(time.perf_counter() - t0)
        num_tokens += sum(len(o.new_token_ids) for o in out.outputs)
    elapsed = time.perf_counter() - start
    mask_count2, mask_sum2 = _mask_totals(engine)
    engine.abort([f"{tag}-{i}" for i in range(batch)])
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    mask_ms = (mask_sum2 - mask_sum) / steps * 1e3 if mask_count2 > mask_count else 0.0
    return {
        "step_ms": statistics.median(times) * 1e3,
        "mask_ms": mask_ms,
        "tok_s": num_tokens / elapsed,
    }


def engine_part(model: str, batches: list[int], steps: int, rounds: int = 3) -> None:
    torch.set_num_threads(1)  # two OpenMP threads stall on this shared 2-core box
    max_seqs = max(batches)
    config = EngineConfig.from_flat(
        model=model,
        num_kv_blocks=max_seqs * 4 + 16,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(2048, max_seqs * PROMPT_LEN),
        max_model_len=256,
        torch_threads=1,
    )
    engine = EngineCore(config)
    run(engine, 2, 1.0, 2, "warmup")  # the tokenizer vocabulary and the grammar, once
    print(f"machine: {machine()}; model {model}; {steps} timed decode steps; "
          f"median of {rounds} interleaved rounds")  # fmt: skip
    print("| model | batch | constrained | step p50 ms | mask ms/step | tok/s | vs none |")
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        results: dict[str, list[dict]] = {name: [] for name, _ in SHARES}
        for k in range(rounds):  # interleaved: a load change hits every share alike
            for name, share in SHARES:
                results[name].append(run(engine, batch, share, steps, f"{name}-{batch}-{k}"))
        base = statistics.median(r["tok_s"] for r in results["none"])
        for name, _ in SHARES:
            med = {
                key: statistics.median(r[key] for r in results[name]) for key in results[name][0]
            }
            print(f"| {model} | {batch} | {name} | {med['step_ms']:.1f} | {med['mask_ms']:.2f} | "
                  f"{med['tok_s']:.0f} | {med['tok_s'] / base - 1:+.1%} |")  # fmt: skip
    engine.shutdown()
