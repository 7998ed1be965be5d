"""Structured outputs: grammar compile time per backend, and what constraining costs a step.

    python -m benchmarks.structured_outputs --part compile            # both backends, both tokenizers
    python -m benchmarks.structured_outputs --part engine --model tiny --batches 1 32 128
    python -m benchmarks.structured_outputs --part spec --batches 1 8 --ks 4

``compile``: for each backend (llguidance, xgrammar) and tokenizer (tiny, smollm2), the
schema set of ``benchmarks/structured_schemas.py`` (22 JSON schemas): compile time p50/p99
cold (a fresh compile) and cached (the compile pool's cache hit,
``workers/structured/manager.py``), and the mask cost: the time to fill one bitmask row
per matcher, averaged over a walk of each schema's greedy-valid path (the matcher advances
by the lowest allowed token each step, so every backend walks the same path); then the
sampler's share, ``apply_grammar_mask`` on [batch, vocab] logits with every row constrained.

``engine`` (``benchmarks/structured_engine.py``): one in-process engine (greedy, ignore_eos) at
batch 1/32/128 with none / half / all requests constrained by a JSON schema that cannot end
within the run: median decode step, bitmask fill per step, output tokens per second; the three
shares interleaved over several rounds (medians), so a change in the machine's load hits each.

``spec`` (``benchmarks/structured_spec.py``): smollm2 requests constrained by a JSON schema that
copy a record from their prompt, with and without n-gram drafts (a grammar row per verified
position): tokens per second and per CPU second, mask fill per step, drafts accepted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks._machine import machine
from benchmarks.structured_schemas import SCHEMAS
from tandem.wire.engine_protocol import StructuredOutputsParams
from tandem.workers.structured.backend import bitmask_width, make_backend
from tandem.workers.structured.manager import GrammarCache


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def compile_part(models: list[str], backends: list[str], repeats: int) -> dict[int, np.ndarray]:
    """Prints the table; returns, per vocabulary size, the llguidance mask rows of the walk
    (real masks for ``apply_part``)."""
    from tandem.workers.checkpoints.model_dir import resolve_model_dir
    from tandem.workers.text.tokenizer import load_tokenizer

    specs = [StructuredOutputsParams("json", json.dumps(s)) for s in SCHEMAS.values()]
    print(f"machine: {machine()}; {len(specs)} schemas")
    print(
        "| model | backend | tokenizer setup s | compile p50 ms | compile p99 ms | cached p50 us "
        "| cached p99 us | mask fill us/row |"
    )
    print("|---|---|---|---|---|---|---|---|")
    walked: dict[int, np.ndarray] = {}
    for model in models:
        tok = load_tokenizer(resolve_model_dir(model))
        vocab = len(tok)
        for name in backends:
            start = time.perf_counter()
            if name == "xgrammar":
                from benchmarks.structured_xgrammar import XGrammarBackend

                backend = XGrammarBackend(tok, vocab, [tok.eos_token_id])
            else:
                backend = make_backend(name, tok, vocab, [tok.eos_token_id])
            setup_s = time.perf_counter() - start
            cold, cached, fills = [], [], []
            for _ in range(repeats):
                cache = GrammarCache(backend, max_entries=64)
                for spec in specs:
                    t0 = time.perf_counter()
                    cache.get_or_compile(spec)
                    cold.append(time.perf_counter() - t0)
                for spec in specs:
                    t0 = time.perf_counter()
                    cache.get_or_compile(spec)
                    cached.append(time.perf_counter() - t0)
            cache = GrammarCache(backend, max_entries=64)
            bitmask = np.zeros((1, bitmask_width(vocab)), dtype=np.int32)
            rows = []
            for spec in specs:
                m = backend.matcher(cache.get_or_compile(spec))
                for _ in range(40):
                    if m.is_terminated():
                        break
                    bitmask[:] = 0
                    t0 = time.perf_counter()
                    m.fill_bitmask(bitmask, 0)
                    fills.append(time.perf_counter() - t0)
                    rows.append(bitmask[0].copy())
                    allowed = np.flatnonzero(
                        np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
                    )
                    if not len(allowed):
                        break
                    # the lowest allowed token that is not EOS, else EOS
                    nxt = next((int(t) for t in allowed if t != tok.eos_token_id), int(allowed[0]))
                    if m.advance([nxt]) != 1:
                        break
            print(
                f"| {model} | {name} | {setup_s:.2f} | {_pct(cold, 0.5) * 1e3:.2f} | "
                f"{_pct(cold, 0.99) * 1e3:.2f} | {_pct(cached, 0.5) * 1e6:.1f} | "
                f"{_pct(cached, 0.99) * 1e6:.1f} | {statistics.mean(fills) * 1e6:.1f} |"
            )
            if name == "llguidance":
                walked[vocab] = np.stack(rows)
    return walked


def apply_part(batches: list[int], walked: dict[int, np.ndarray], repeats: int = 20) -> None:
    """The sampler's share: ``apply_grammar_mask`` on [batch, V] float32 logits, every row
    constrained, with the real masks of the schema walk (cycled) and with random 50% masks
    (the worst case for its branch); median of ``repeats``."""
    import torch

    from tandem.workers.sampling.grammar_mask import GrammarRows, apply_grammar_mask

    torch.set_num_threads(1)  # as the tests' engines run on this 2-core box
    print("| vocab | batch | walk masks ms | random masks ms |")
    print("|---|---|---|---|")
    for vocab, real in walked.items():
        for batch in batches:
            logits = torch.randn(batch, vocab)
            rng = np.random.default_rng(0)
            noise = rng.integers(-(2**31), 2**31, (batch, real.shape[1]), dtype=np.int64)
            cycled = np.ascontiguousarray(real[np.arange(batch) % len(real)])
            cells = []
            for bits in (cycled, noise.astype(np.int32)):
                rows = GrammarRows(list(range(batch)), bits)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    apply_grammar_mask(logits, rows)
                    times.append(time.perf_counter() - t0)
                cells.append(f"{statistics.median(times) * 1e3:.2f}")
            print(f"| {vocab} | {batch} | {cells[0]} | {cells[1]} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("compile", "engine", "spec"), default="compile")
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--backends", nargs="+", default=["llguidance", "xgrammar"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ks", nargs="+", type=int, default=[4], help="--part spec: draft lengths")
    args = p.parse_args()
    if args.part == "compile":
        apply_part(args.batches, compile_part(args.models, args.backends, args.repeats))
    elif args.part == "spec":
        from benchmarks.structured_spec import spec_part

        spec_part(args.batches, args.ks, args.rounds)
    else:
        from benchmarks.structured_engine import engine_part

        engine_part(args.model, args.batches, args.steps, args.rounds)


if __name__ == "__main__":
    main()
