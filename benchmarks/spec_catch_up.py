"""A draft model's catch-up on a decode engine: the longest step before/after chunking it
by the token budget (issue #26). ``benchmarks/spec_decode.py --catch-up`` runs it.

    PYTHONPATH=$(python3 benchmarks/checkout.py $PWD) \\
        .venv/bin/python benchmarks/spec_decode.py --catch-up --budget 256

One smollm2 engine (fp32, CPU) with smollm2 as its own draft model (K = 2). The P/D shape
without a second process: the eight copy-workload prompts (about 260 tokens each) are
prefilled once with ``max_tokens`` 1, so that when they arrive again together the target
finds their KV (prefix hits, as a decode engine finds a prefill engine's) and the draft
finds none, as after a handoff. Two chat requests are already decoding (with drafts)
when the eight arrive. Printed, for the window from the eight's arrival until they finish:

    longest step    the slowest engine step (what every running request waits for), and
                    the most CPU time one step took (this process, one torch thread: on a
                    shared box wall time also carries the other processes' load)
    step p50        the median step
    bg ITL max      the longest gap between two outputs of a background request
    first token     mean time from arrival to an arriving request's first output
    catch-up        draft positions recomputed in the window, in how many steps, and the
                    most in one step (from the drafter's counter: the same on both sides)
    tokens          a digest of every request's greedy tokens (equal before and after)

Run it once per checkout (PYTHONPATH picks the code: this worktree's, and /work/main's for
"before"); the script imports only what both have.
"""

from __future__ import annotations

import hashlib
import statistics
import time

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tandem.workers.text.tokenizer import load_tokenizer


def self_drafting_engine(
    torch_threads: int,
    num_kv_blocks: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    model: str = "smollm2",
    device: str = "cpu",
    dtype: str = "float32",
    **engine_fields,
) -> EngineCore:
    """smollm2 (fp32, CPU) with smollm2 as its own draft model, K = 2: both benchmarks' engine
    (``max_model_len`` 1024; the draft's KV cache has as many blocks as the target's).
    ``spec_decode.py --model/--device/--dtype`` put another model (drafting for itself) on
    another device."""
    return EngineCore(
        EngineConfig.from_flat(
            model=model,
            device=device,
            dtype=dtype,
            max_model_len=1024,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            torch_threads=torch_threads,
            speculative_config={
                "method": "draft_model",
                "model": model,
                "num_speculative_tokens": 2,
            },  # fmt: skip
            **engine_fields,
        )
    )


def run_catch_up(args, machine: str, copy_prompts, chat_prompts, encode) -> None:
    budget = args.budget
    engine = self_drafting_engine(args.torch_threads, 1024, budget, 32)
    tok = load_tokenizer(engine.model_path)
    arriving = [encode(tok, t) for t in copy_prompts(8)]
    background = [encode(tok, t) for t in chat_prompts(2)]
    drafter = engine.runner.drafter
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(arriving):  # their target KV, as a prefill engine's
        assert engine.add_request(EngineRequest(f"warm{i}", p, greedy)) is None
    while engine.has_work():
        engine.step()
    tokens: dict[str, list[int]] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    firsts: list[float] = []

    def step() -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step().outputs
        now = time.perf_counter()
        for o in outs:
            assert o.error is None, o.error
            if o.request_id.startswith("bg") and o.request_id in last and arrived is not None:
                gaps.append(now - last[o.request_id])
            if not tokens[o.request_id] and o.request_id.startswith("new"):
                firsts.append(now - arrived)
            tokens[o.request_id].extend(o.new_token_ids)
            last[o.request_id] = now
        cpu.append(time.process_time() - c0)
        return now - t0

    arrived = None
    cpu: list[float] = []  # CPU seconds of each step (one torch thread: its compute)
    bg_sp = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(background):
        tokens[f"bg{i}"] = []
        assert engine.add_request(EngineRequest(f"bg{i}", p, bg_sp)) is None
    while min(len(tokens[f"bg{i}"]) for i in range(len(background))) < 6:
        step()
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    arrived = time.perf_counter()
    for i, p in enumerate(arriving):
        tokens[f"new{i}"] = []
        assert engine.add_request(EngineRequest(f"new{i}", p, sp)) is None
    steps, catch_ups = [], []
    cpu.clear()
    while any(len(tokens[f"new{i}"]) < args.output_len for i in range(len(arriving))):
        before = drafter.num_catch_up_tokens
        steps.append(step())
        catch_ups.append(drafter.num_catch_up_tokens - before)
    window = time.perf_counter() - arrived
    engine.abort([f"bg{i}" for i in range(len(background))])
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    digest = hashlib.sha1(
        repr([tokens[f"new{i}"] for i in range(len(arriving))]).encode()
    ).hexdigest()[:12]
    big = [n for n in catch_ups if n > 8]
    print(f"machine: {machine}; torch threads {args.torch_threads}")
    print(
        f"smollm2 fp32 CPU, self-draft K=2, max_num_batched_tokens {budget}; 8 arriving "
        f"prompts of {statistics.mean(map(len, arriving)):.0f} tokens (target KV cached, no "
        f"draft KV), {args.output_len} tokens each; 2 background chat requests decoding\n"
    )
    print(
        f"{'steps':>5} {'longest step':>12} {'(CPU)':>7} {'step p50':>8} {'bg ITL max':>10} "
        f"{'first token':>11} {'window':>7}  catch-up (positions / steps / most)  tokens"
    )
    print(
        f"{len(steps):>5} {max(steps) * 1e3:>10.0f}ms {max(cpu) * 1e3:>5.0f}ms "
        f"{statistics.median(steps) * 1e3:>6.0f}ms {max(gaps) * 1e3:>8.0f}ms "
        f"{statistics.mean(firsts):>10.2f}s {window:>6.1f}s  "
        f"{sum(catch_ups)} / {len(big)} / {max(catch_ups)}  {digest}"
    )
    engine.shutdown()
