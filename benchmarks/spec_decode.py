"""Speculative decoding (n-gram prompt lookup, a draft model) against plain decoding.

    .venv/bin/python benchmarks/spec_decode.py                     # batches 1, 8, 32
    .venv/bin/python benchmarks/spec_decode.py --batches 1 --output-len 48
    .venv/bin/python benchmarks/spec_decode.py --catch-up --budget 256 --output-len 8

smollm2 (SmolLM2-135M-Instruct from the built-in GGUF, fp32, CPU), greedy, EOS ignored,
``--output-len`` tokens per request. Two workloads, chat-templated:

    copy   a function of this repository (130-420 tokens) to repeat with a comment added:
           most of the answer is in the prompt
    chat   open questions: nothing to copy

For every batch and workload one engine serves the rows in turn: ``none`` (no drafts) and
``ngram`` with K = 2, 4, 8 (prompt_lookup_min 2, max 4; adaptive drafting on, as
configured by default), and ``draft`` with K = 2, 4: smollm2 as its own draft model
(``--draft-ks``; the draft shares the target's weights and has its own KV cache, so its
acceptance is near 1 and its cost is K draft forwards of the target's size per step). The clock starts once every request has its first token, so the
columns describe decoding only (after the first row the prompts are prefix-cache hits,
which shortens the untimed part):

    tok/s        output tokens / seconds from the moment every request has its first token
    tok/cpu-s    the same tokens / this process's CPU seconds over that time: on a shared
                 box other processes' load stretches wall time, much less CPU time, so
                 this is the column to compare rows by (with one torch thread)
    ITL p50/p99  gap between two successive outputs of one request (an output may carry
                 several tokens when drafts are accepted), milliseconds
    vs none      tok/cpu-s relative to the ``none`` row of the same batch and workload
    accept/pos   fraction of steps with drafts whose draft j was accepted, j = 1..K, and
                 how many of the row's engine steps carried any draft
    same         the tokens equal the ``none`` row's (greedy: they must)

After the draft rows of a batch and workload, one line measures the draft's catch-up:
every row after the first is a prefix-cache hit, so the draft recomputes each prompt in
its first fill, as a decode engine's draft does after a P/D handoff (which carries no
draft KV). It prints those fills' time against the median step of the draft rows.

The speculative rows switch the engine's scheduler between configurations
(``Scheduler.spec``); that is what ``--speculative-config`` sets at start.
Batch 1 serves ``--serial`` prompts (default 8) one at a time and sums their decoding time:
one prompt is one model's answer to one file (``--serial 0``: the first prompt alone).

``--repeats`` runs the rows of a batch and workload that many times, interleaved (the
machine's other load drifts), and keeps each row's median tok/s; the ITL percentiles
pool every repeat; accept/pos is the last repeat's.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from tandem.scheduler.spec.adaptive import DraftPolicy  # noqa: E402
from tandem.scheduler.spec.config import SpeculativeConfig  # noqa: E402
from tandem.scheduler.spec.lookahead import Lookahead  # noqa: E402
from tandem.wire.engine_protocol import EngineRequest, SamplingParams  # noqa: E402
from tandem.workers.text.tokenizer import apply_chat_template, load_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = [
    "Why is the sky blue?",
    "Give me three ideas for a birthday party.",
    "What makes a good cup of coffee?",
    "Explain how a bicycle stays upright.",
    "Write a short poem about autumn.",
    "What should I pack for a weekend hike?",
    "How do plants make food?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "How can I sleep better?",
    "Why do cats purr?",
]


COPY_INSTRUCTION = (
    "Add a short comment above the `def` line of this Python function. Reply with the "
    "complete function, otherwise unchanged:"
)


def copy_prompts(n: int) -> list[str]:
    """The copy workload: whole functions of this repository's ``scheduler/*.py`` (those of
    300-1200 characters, dedented, in file order: 74 of them today, the first
    ``admission.validate_request``), each given with ``COPY_INSTRUCTION``::

        Add a short comment above the `def` line of this Python function. Reply with the
        complete function, otherwise unchanged:

        ```python
        def validate_request(sched: Scheduler, request: Request) -> None:
            ...
        ```

    An edit whose answer is the prompt's code plus one line. Whole functions, not fixed
    slices, so the model sees code that ends where a function ends. The requests of a
    batch take the functions in order (batch 1: the first one only)."""
    functions = []
    for path in sorted(glob.glob(os.path.join(ROOT, "scheduler", "*.py"))):
        source = open(path).read()
        lines = source.splitlines(keepends=True)
        nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
        for node in sorted(nodes, key=lambda n: n.lineno):
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            code = textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))
            if 300 <= len(code) <= 1200:
                functions.append(code.rstrip("\n"))
    return [
        f"{COPY_INSTRUCTION}\n\n```python\n{functions[i % len(functions)]}\n```" for i in range(n)
    ]


def chat_prompts(n: int) -> list[str]:
    return [QUESTIONS[i % len(QUESTIONS)] + (f" (variant {i})" if i >= len(QUESTIONS) else "")
            for i in range(n)]  # fmt: skip


def encode(tokenizer, text: str) -> list[int]:
    return apply_chat_template(tokenizer, [{"role": "user", "content": text}])


def run_row(engine, prompts, output_len, run, serial: int = 0):
    """``(tok/s, tok/cpu-s, gaps, tokens)`` of the prompts served together, or with
    ``serial`` of them served one at a time (batch 1): every prompt alone, the rates over
    their decoding time summed."""
    if not serial:
        return _run_batch(engine, prompts, output_len, run)
    num = seconds = cpu_seconds = 0.0
    gaps: list[float] = []
    tokens: list[list[int]] = []
    for i, prompt in enumerate(prompts[:serial]):
        rate, cpu_rate, row_gaps, out = _run_batch(engine, [prompt], output_len, f"{run}.{i}")
        decoded = sum(len(t) for t in out) - len(out)  # after each first token
        num, seconds, cpu_seconds = (
            num + decoded,
            seconds + decoded / rate,
            (cpu_seconds + decoded / cpu_rate),
        )
        gaps += row_gaps
        tokens += out
    return num / seconds, num / cpu_seconds, gaps, tokens


def _run_batch(
    engine, prompts, output_len, run
) -> tuple[float, float, list[float], list[list[int]]]:
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [f"{run}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        err = engine.add_request(EngineRequest(rid, p, sp))
        assert err is None, err.error
    tokens = {rid: [] for rid in ids}
    last = {}
    gaps: list[float] = []
    start = None
    num_decode = 0
    while engine.has_work():
        outs = engine.step().outputs
        now = time.perf_counter()
        for o in outs:
            if start is not None:
                gaps.append(now - last[o.request_id])
                num_decode += len(o.new_token_ids)
            tokens[o.request_id].extend(o.new_token_ids)
            last[o.request_id] = now
        if start is None and all(tokens.values()):
            start, cpu_start = now, time.process_time()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    engine.check_integrity()
    return num_decode / seconds, num_decode / max(cpu_seconds, 1e-9), gaps, [tokens[r] for r in ids]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--workloads", default="copy,chat")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--draft-ks", default="2,4", help="draft-model rows ('' for none)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--serial",
        type=int,
        default=8,
        help="batch 1 serves this many prompts, one at a time (0: the first prompt only, "
        "as before session 10): one prompt is one model's answer to one file",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="the speculative config's field"
    )
    ap.add_argument(
        "--before",
        action="store_true",
        help="also ngram rows with the adaptive policy before issue #26's batch-aware one "
        "(rows 'ngramKv0': caps start at K, halve to 0, each request probes every 16 steps)",
    )
    ap.add_argument(
        "--catch-up",
        action="store_true",
        help="instead of the table: the draft's catch-up on a P/D-like decode engine, "
        "longest step and ITL (benchmarks/spec_catch_up.py)",
    )
    ap.add_argument("--budget", type=int, default=256, help="--catch-up's max_num_batched_tokens")
    ap.add_argument(
        "--model",
        default="smollm2",
        help="the target, drafting for itself in the draft rows: smollm2, tiny, a checkpoint "
        "directory, or 1b (a seeded random Llama-3.2-1B-shaped checkpoint written on CUDA, "
        "benchmarks/gpu_engine.py's, with --tokenizer's files: the GPU rows)",
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument(
        "--cuda-graph-mode",
        default=None,
        help="CUDA: the engine's --cuda-graph-mode (default: the engine's); full_and_piecewise "
        "puts drafted steps in piecewise graphs, decode-only steps in full ones",
    )
    ap.add_argument("--dtype", default=None, help="default float32 (bfloat16 for --model 1b)")
    ap.add_argument(
        "--tokenizer",
        default=os.path.join(ROOT, "gpu", "smollm2-tokenizer"),
        help="--model 1b: a directory with the tokenizer and chat template to write beside it "
        "(`python benchmarks/spec_decode.py --save-tokenizer DIR` writes smollm2's)",
    )
    ap.add_argument(
        "--save-tokenizer", default=None, help="write smollm2's tokenizer files to DIR and exit"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    if args.save_tokenizer:
        save_smollm2_tokenizer(args.save_tokenizer)
        return
    dtype = args.dtype or ("bfloat16" if args.model == "1b" else "float32")
    if args.catch_up:
        from benchmarks.spec_catch_up import run_catch_up

        run_catch_up(args, machine(), copy_prompts, chat_prompts, encode)
        return
    from benchmarks.spec_catch_up import self_drafting_engine

    # the runner gets a drafter; each row sets the scheduler's proposer
    model, label = target_model(args)
    graphs = {"cuda_graph_mode": args.cuda_graph_mode} if args.cuda_graph_mode else {}
    engine = self_drafting_engine(
        args.torch_threads, 2048, 1024, 64, model=model, device=args.device, dtype=dtype, **graphs
    )
    tokenizer = load_tokenizer(engine.model_path)
    on_gpu = args.device == "cuda"
    print(f"machine: {machine()}; torch threads {args.torch_threads}")
    if on_gpu:
        print(f"device: {torch.cuda.get_device_name(0)}")
    print(
        f"{label} {dtype} {args.device}"
        + (f" (cuda_graph_mode {engine.config.graphs.cuda_graph_mode})" if on_gpu else "")
        + f", greedy, {args.output_len} output tokens per request"
    )
    print(f"vs none: {'tok/s (wall)' if on_gpu else 'tok/cpu-s'} against the none row\n")
    header = (
        f"{'workload':8} {'batch':>5} {'method':8} {'tok/s':>8} {'tok/cpu-s':>9} {'vs none':>8} "
        f"{'ITL p50':>8} {'ITL p99':>8}  {'same':4}  accept/pos"
    )
    print(header)
    print("-" * len(header))
    kv = engine.scheduler.kv
    # (name, a fresh Lookahead for each batch and workload, as an engine starting anew)
    methods: list[tuple[str, Callable[[], Lookahead] | None]] = [("none", None)]
    dbs = args.disable_by_batch_size
    for k in (int(x) for x in args.ks.split(",") if x):
        cfg = SpeculativeConfig("ngram", k, 2, 4, disable_by_batch_size=dbs)
        methods.append((f"ngram{k}", lambda cfg=cfg: Lookahead(cfg, kv)))
        if args.before:
            methods.append((f"ngram{k}v0", lambda cfg=cfg: before_policy(Lookahead(cfg, kv))))
    for k in (int(x) for x in args.draft_ks.split(",") if x):
        cfg = SpeculativeConfig("draft_model", k, disable_by_batch_size=dbs, model=model)
        methods.append((f"draft{k}", lambda cfg=cfg: Lookahead(cfg, kv)))
    fills = FillTimer(engine.runner.drafter)
    drafting = DraftingSteps(engine.scheduler)
    steps = StepTimer(engine)
    run_id = 0
    for workload in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            serial = args.serial if batch == 1 else 0
            n = max(batch, serial)
            texts = copy_prompts(n) if workload == "copy" else chat_prompts(n)
            prompts = [encode(tokenizer, t) for t in texts]
            engine.scheduler.spec = None
            run_row(engine, prompts[:1], 2, f"warm{run_id}")
            rates = {name: [] for name, _ in methods}
            cpu_rates = {name: [] for name, _ in methods}
            gaps = {name: [] for name, _ in methods}
            tokens, accept = {}, {}
            specs = {name: make() if make else None for name, make in methods}
            for _ in range(args.repeats):  # interleaved: the machine's load drifts
                for name, _ in methods:
                    spec = specs[name]
                    engine.scheduler.spec = spec
                    fills.on = steps.on = name.startswith("draft")
                    run_id += 1
                    before = _counts(spec)
                    drafting.reset()
                    rate, cpu_rate, row_gaps, tokens[name] = run_row(
                        engine, prompts, args.output_len, f"r{run_id}", serial
                    )
                    rates[name].append(rate)
                    cpu_rates[name].append(cpu_rate)
                    gaps[name] += row_gaps
                    accept[name] = _acceptance(spec, before)
                    if spec is not None:
                        accept[name] += f" ({drafting.report()})"
            # on a GPU the host's CPU time is not the cost: compare wall-clock rates there
            compared = rates if on_gpu else cpu_rates
            base = statistics.median(compared["none"])
            for name, _ in methods:
                tps = statistics.median(rates[name])
                cpu_tps = statistics.median(cpu_rates[name])
                print(
                    f"{workload:8} {batch:>5} {name:8} {tps:>8.1f} {cpu_tps:>9.1f} "
                    f"{statistics.median(compared[name]) / base:>7.2f}x "
                    f"{percentile(gaps[name], 0.5) * 1e3:>8.1f} "
                    f"{percentile(gaps[name], 0.99) * 1e3:>8.1f}  "
                    f"{'yes' if tokens[name] == tokens['none'] else 'NO':4}  {accept[name]}",
                    flush=True,
                )
            if fills.calls:
                print(f"{'':8} {batch:>5} draft catch-up: {fills.report(steps)}", flush=True)
            fills.reset()
            steps.reset()
    engine.shutdown()


def target_model(args) -> tuple[str, str]:
    """(the engine's ``model``, the label printed) for ``--model``."""
    if args.model != "1b":
        return args.model, args.model
    import shutil
    import tempfile

    from benchmarks.gpu_engine import make_1b_checkpoint

    if args.device != "cuda":
        raise SystemExit("--model 1b is written on CUDA: add --device cuda")
    if not os.path.isdir(args.tokenizer):
        raise SystemExit(f"--tokenizer {args.tokenizer}: no such directory (--save-tokenizer)")
    path = make_1b_checkpoint(tempfile.mkdtemp(prefix="spec-1b-"))
    for name in os.listdir(args.tokenizer):
        shutil.copy(os.path.join(args.tokenizer, name), path)
    return path, "random Llama-3.2-1B shape (smollm2's tokenizer)"


def save_smollm2_tokenizer(out: str) -> None:
    """smollm2's tokenizer and chat template (from the built-in GGUF's converted directory)
    as plain files, a few MB: what ``--model 1b`` reads on a GPU box without the GGUF."""
    from tandem.workers.checkpoints.loader import resolve_model_path

    load_tokenizer(resolve_model_path("smollm2")).save_pretrained(out)
    print(f"wrote {out}: {sorted(os.listdir(out))}")


class HalvingPolicy(DraftPolicy):
    """The adaptive drafting before the batch-aware policy, for ``--before`` rows: a cap
    starting at K, +1 when every draft is kept, the kept run + 1 when some are, halved
    when none is; at 0 a one-draft probe every 16 steps of the request's own."""

    def begin_step(self, num_running: int) -> None:
        pass

    def cap(self, req) -> int:
        cap = self.k if req.spec_k < 0 else req.spec_k
        if cap == 0:
            req.spec_wait -= 1
            if req.spec_wait > 0:
                return 0
            cap = 1
        return cap

    def update(self, req, num_drafts: int, num_accepted: int) -> None:
        cap = self.k if req.spec_k < 0 else req.spec_k
        if num_accepted == num_drafts:
            req.spec_k = min(self.k, max(cap, num_accepted) + 1)
        elif num_accepted:
            req.spec_k = num_accepted + 1
        else:
            req.spec_k = cap // 2
            if req.spec_k == 0:
                req.spec_wait = 16

    def check_integrity(self, running) -> None:
        pass  # its counters have other bounds


def before_policy(spec: Lookahead) -> Lookahead:
    spec.policy = HalvingPolicy(spec.k)
    return spec


class DraftingSteps:
    """How many of the scheduler's steps with several running requests carried drafts
    (the steps a verification costs), out of how many."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.inner = scheduler, scheduler.schedule
        scheduler.schedule = self
        self.reset()

    def reset(self) -> None:
        self.steps = self.drafted = 0

    def __call__(self):
        out = self.inner()
        self.steps += 1
        self.drafted += bool(out.scheduled_spec_decode_tokens)
        return out

    def report(self) -> str:
        return f"{self.drafted}/{self.steps} steps drafted"


class FillTimer:
    """Times the drafter's fills; a fill that recomputes at least ``CATCH_UP`` tokens
    (a prompt) counts as a catch-up."""

    CATCH_UP = 32

    def __init__(self, drafter) -> None:
        self.drafter, self.inner, self.on = drafter, drafter.fill, False
        drafter.fill = self
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[int, float]] = []  # (tokens recomputed, seconds)

    def __call__(self, spec, segments, catch_up=()) -> None:
        before, t = self.drafter.num_catch_up_tokens, time.perf_counter()
        self.inner(spec, segments, catch_up)
        if self.on:
            self.calls.append((self.drafter.num_catch_up_tokens - before, time.perf_counter() - t))

    def report(self, steps: StepTimer) -> str:
        big = [(n, s) for n, s in self.calls if n >= self.CATCH_UP]
        rest = [s for n, s in self.calls if n < self.CATCH_UP]
        step = statistics.median(steps.seconds) if steps.seconds else float("nan")
        if not big:
            return f"none of {self.CATCH_UP}+ tokens; median step {step * 1e3:.1f} ms"
        tokens = sum(n for n, _ in big) / len(big)
        seconds = sum(s for _, s in big) / len(big)
        other = statistics.median(rest) if rest else float("nan")
        return (
            f"{len(big)} fills recomputing {tokens:.0f} tokens on average: {seconds * 1e3:.1f} ms "
            f"each ({seconds / step:.1f} median steps of {step * 1e3:.1f} ms; a fill without "
            f"catch-up {other * 1e3:.1f} ms)"
        )


class StepTimer:
    """The engine's step times while ``on``."""

    def __init__(self, engine) -> None:
        self.inner, self.on = engine.step, False
        engine.step = self
        self.reset()

    def reset(self) -> None:
        self.seconds: list[float] = []

    def __call__(self):
        t = time.perf_counter()
        out = self.inner()
        if self.on:
            self.seconds.append(time.perf_counter() - t)
        return out


def _counts(spec: Lookahead | None):
    if spec is None:
        return None
    s = spec.stats
    return s.num_drafts, list(s.accepted_per_pos)


def _acceptance(spec: Lookahead | None, before) -> str:
    if spec is None:
        return "-"
    num = spec.stats.num_drafts - before[0]
    if not num:
        return "no drafts"
    per_pos = [a - b for a, b in zip(spec.stats.accepted_per_pos, before[1])]
    return f"{num} drafts: " + " ".join(f"{x / num:.2f}" for x in per_pos)


if __name__ == "__main__":
    main()
