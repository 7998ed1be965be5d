"""The speculative part of ``benchmarks/structured_outputs.py``: constrained requests with and
without n-gram drafts.

    python -m benchmarks.structured_outputs --part spec --batches 1 8

smollm2 (fp32, CPU, one torch thread), greedy. Every request is constrained by one JSON schema
(a person record) and asked to copy a record given in its prompt, so most of the answer is in
the prompt, the case prompt lookup is for. One engine serves the rows in turn, interleaved over
``--rounds`` (medians): ``constrained`` (no drafts) and ``constrained+ngramK`` (prompt_lookup
2..4). Each verified position of a constrained request costs one more mask row (its grammar
walked through the drafts and rolled back), which ``mask ms/step`` shows. The clock starts once
every request has its first token (decoding only).

    tok/s        output tokens / seconds of decoding
    tok/cpu-s    the same tokens / this process's CPU seconds (steadier on a shared box)
    vs base      tok/cpu-s over the ``constrained`` row's
    mask ms/step the scheduler's bitmask fill per step (all rows, drafts included)
    accepted     accepted drafts / drafted tokens
    same         tokens equal the ``constrained`` row's (greedy: they must)
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks._machine import machine
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.scheduler.spec.lookahead import Lookahead
from tandem.wire.engine_protocol import EngineRequest, SamplingParams, StructuredOutputsParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tandem.workers.text.tokenizer import apply_chat_template, load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "city", "age", "tags"],
    "additionalProperties": False,
}
NAMES = ["Alice Johnson", "Bruno Diaz", "Chen Wei", "Dana Okafor", "Emil Larsen", "Fatima Noor",
         "Gustav Berg", "Hana Sato"]  # fmt: skip
CITIES = ["San Francisco", "Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Lima", "Perth"]
TAGS = ["engineer", "runner", "chess", "violin", "gardening", "sailing", "poetry", "cycling"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        record = {"name": NAMES[i % 8], "city": CITIES[(3 * i) % 8], "age": 20 + 7 * i % 60,
                  "tags": [TAGS[i % 8], TAGS[(i + 3) % 8], TAGS[(i + 5) % 8]]}  # fmt: skip
        text = "Copy this JSON record exactly, nothing else: " + json.dumps(
            record, separators=(",", ":")
        )
        out.append(apply_chat_template(tokenizer, [{"role": "user", "content": text}]))
    return out


def _mask_totals(engine: EngineCore) -> tuple[int, float]:
    snap = engine.structured.make_stats().mask_seconds
    return snap.count, snap.sum


def run_row(engine: EngineCore, ids: list[list[int]], tag: str) -> dict:
    so = StructuredOutputsParams("json", json.dumps(SCHEMA))
    sp = SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=so)
    rids = [f"{tag}-{i}" for i in range(len(ids))]
    for rid, p in zip(rids, ids):
        err = engine.add_request(EngineRequest(rid, p, sp))
        assert err is None, err.error
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    start = cpu_start = None
    num_decode = steps = 0
    masks = (0, 0.0)
    while engine.has_work():
        outs = engine.step().outputs
        now = time.perf_counter()
        for o in outs:
            assert o.error is None, o.error
            if start is not None:
                num_decode += len(o.new_token_ids)
            tokens[o.request_id].extend(o.new_token_ids)
        if start is not None:
            steps += 1
        elif all(tokens.values()):
            start, cpu_start = now, time.process_time()
            masks = _mask_totals(engine)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    engine.check_integrity()
    mask_s = _mask_totals(engine)[1] - masks[1]
    return {
        "tps": num_decode / seconds,
        "cpu_tps": num_decode / max(cpu, 1e-9),
        "mask_ms": 1e3 * mask_s / max(steps, 1),
        "tokens": [tokens[r] for r in rids],
    }


def spec_part(batches: list[int], ks: list[int], rounds: int) -> None:
    torch.set_num_threads(1)
    engine = EngineCore(
        EngineConfig.from_flat(
            model="smollm2",
            dtype="float32",
            max_model_len=1024,
            num_kv_blocks=2048,
            max_num_batched_tokens=1024,
            torch_threads=1,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    )
    tokenizer = load_tokenizer(engine.model_path)
    kv = engine.scheduler.kv
    methods: list[tuple[str, Lookahead | None]] = [("constrained", None)]
    for k in ks:
        methods.append(
            (f"constrained+ngram{k}", Lookahead(SpeculativeConfig("ngram", k, 2, 4), kv))
        )
    print(f"machine: {machine()}; smollm2 fp32 CPU, 1 torch thread, greedy, copy a JSON record")
    print("| batch | method | tok/s | tok/cpu-s | vs base | mask ms/step | accepted | same |")
    print("|---|---|---|---|---|---|---|---|")
    run_id = 0
    for batch in batches:
        ids = prompts(tokenizer, batch)
        engine.scheduler.spec = None
        run_row(engine, ids[:1], "warm")  # compiles the grammar, warms the prefix cache
        rows: dict[str, list[dict]] = {name: [] for name, _ in methods}
        accepted: dict[str, tuple[int, int]] = {}
        for _ in range(rounds):  # interleaved: the machine's load drifts
            for name, spec in methods:
                engine.scheduler.spec = spec
                before = (
                    (spec.stats.num_accepted_tokens, spec.stats.num_draft_tokens) if spec else None
                )
                run_id += 1
                rows[name].append(run_row(engine, ids, f"r{run_id}"))
                if spec is not None:
                    accepted[name] = (spec.stats.num_accepted_tokens - before[0],
                                      spec.stats.num_draft_tokens - before[1])  # fmt: skip
        base = statistics.median(r["cpu_tps"] for r in rows["constrained"])
        for name, _ in methods:
            tps = statistics.median(r["tps"] for r in rows[name])
            cpu_tps = statistics.median(r["cpu_tps"] for r in rows[name])
            mask = statistics.median(r["mask_ms"] for r in rows[name])
            acc = f"{accepted[name][0]}/{accepted[name][1]}" if name in accepted else "-"
            same = all(r["tokens"] == rows["constrained"][0]["tokens"] for r in rows[name])
            print(f"| {batch} | {name} | {tps:.1f} | {cpu_tps:.1f} | {cpu_tps / base:.2f}x | "
                  f"{mask:.2f} | {acc} | {'yes' if same else 'NO'} |", flush=True)  # fmt: skip
    engine.shutdown()
