"""Trace replay for ``tandem bench --trace``: public request-trace formats in,
token-id prompts and send times out.

    Mooncake JSONL, one request a line:
        {"timestamp": 27482, "input_length": 6955, "output_length": 52,
         "hash_ids": [46, 47, 48, ...]}
        ``timestamp`` in milliseconds; each hash id names one block of
        ``block_tokens`` prompt tokens (512 in the published traces), the
        same id in two requests meaning the same block of shared prefix.
    Azure LLM inference trace CSV:
        TIMESTAMP,ContextTokens,GeneratedTokens
        2023-11-16 18:15:46.6805900,374,44
        no prefix information: every prompt is distinct.

Prompt synthesis: block ``i`` of a request is the token ids drawn from a
generator seeded by ``(seed, hash_ids[i])``, so equal hash ids give equal
blocks in every request; tokens past the hashed blocks (and every token of an
Azure request) come from the request's own generator. ``time_scale``
multiplies the trace's clock (0.1 replays ten times faster).

``synthesize`` writes a Mooncake-format trace with the shapes that make
prefix-aware routing matter: multi-turn sessions (turn t repeats turn t-1's
blocks, then adds the answer and a new question), a few shared system
prompts, and documents chosen by a Zipf law. ``python -m tandem.cluster.cli.trace_replay
--out trace.jsonl`` runs it.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import random
import sys
from dataclasses import dataclass, field

MOONCAKE_BLOCK_TOKENS = 512


@dataclass
class TraceRequest:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trace``, ``--time-scale`` and ``--trace-block-tokens``: one
    definition for every command that replays a trace (``tandem bench``,
    ``tandem simulate``, ``tandem plan``)."""
    parser.add_argument(
        "--trace",
        help="replay a Mooncake JSONL or Azure CSV trace (its lengths and times; "
        "--num-requests, --input-len, --output-len and --request-rate do not apply)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="trace clock x this (0.1: 10x faster)"
    )
    parser.add_argument(
        "--trace-block-tokens",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        help=f"prompt tokens per trace hash id (Mooncake: {MOONCAKE_BLOCK_TOKENS})",
    )


def load_trace(path: str) -> list[TraceRequest]:
    """A Mooncake JSONL (``*.jsonl``/``*.json``) or Azure CSV (``*.csv``)
    trace, sorted by time, clock starting at 0. ``ValueError`` naming the
    file, line and field on a bad row."""
    if path.endswith(".csv"):
        rows = _load_azure(path)
    else:
        rows = _load_mooncake(path)
    if not rows:
        raise ValueError(f"--trace {path}: no requests")
    rows.sort(key=lambda r: r.timestamp_s)
    t0 = rows[0].timestamp_s
    for r in rows:
        r.timestamp_s -= t0
    return rows


def _positive(path: str, line: int, name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"--trace {path}:{line}: {name} must be an integer >= {minimum}")
    return value


def _load_mooncake(path: str) -> list[TraceRequest]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--trace {path}:{line_no}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"--trace {path}:{line_no}: expected an object")
            ts = obj.get("timestamp", 0)
            if not isinstance(ts, (int, float)) or ts < 0:
                raise ValueError(f"--trace {path}:{line_no}: timestamp must be a number >= 0")
            hash_ids = obj.get("hash_ids", [])
            if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
            ):
                raise ValueError(f"--trace {path}:{line_no}: hash_ids must be a list of integers")
            rows.append(
                TraceRequest(
                    ts / 1000.0,
                    _positive(path, line_no, "input_length", obj.get("input_length")),
                    _positive(path, line_no, "output_length", obj.get("output_length")),
                    hash_ids,
                )
            )
    return rows


def _load_azure(path: str) -> list[TraceRequest]:
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"--trace {path}: missing columns {sorted(missing)}")
        for line_no, rec in enumerate(reader, 2):
            try:
                ts = _azure_time_s(rec["TIMESTAMP"])
                ctx, gen = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            except ValueError:
                raise ValueError(
                    f"--trace {path}:{line_no}: bad TIMESTAMP or token count"
                ) from None
            rows.append(
                TraceRequest(
                    ts,
                    _positive(path, line_no, "ContextTokens", ctx),
                    _positive(path, line_no, "GeneratedTokens", gen),
                )
            )
    return rows


def _azure_time_s(text: str) -> float:
    """``2023-11-16 18:15:46.6805900`` (7 fractional digits) -> epoch seconds."""
    date, _, frac = text.strip().partition(".")
    base = datetime.datetime.fromisoformat(date).replace(tzinfo=datetime.timezone.utc)
    return base.timestamp() + (float("0." + frac) if frac else 0.0)


def synthesize_prompt(
    req: TraceRequest, index: int, vocab_size: int, seed: int, block_tokens: int
) -> list[int]:
    """Token ids of one request: equal hash ids give equal blocks (module doc)."""
    tokens: list[int] = []
    for h in req.hash_ids:
        if len(tokens) >= req.input_length:
            break
        rng = random.Random(f"{seed}:block:{h}")
        tokens += [rng.randrange(vocab_size) for _ in range(block_tokens)]
    rng = random.Random(f"{seed}:request:{index}")
    while len(tokens) < req.input_length:
        tokens.append(rng.randrange(vocab_size))
    return tokens[: req.input_length]


def trace_workload(
    path: str, vocab_size: int, seed: int, time_scale: float, block_tokens: int
) -> tuple[list[list[int]], list[int], list[float]]:
    """Prompts, output lengths and send offsets (seconds) of a trace file."""
    if not time_scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {time_scale}")
    if block_tokens < 1:
        raise ValueError(f"--trace-block-tokens must be >= 1, got {block_tokens}")
    rows = load_trace(path)
    prompts = [synthesize_prompt(r, i, vocab_size, seed, block_tokens) for i, r in enumerate(rows)]
    return prompts, [r.output_length for r in rows], [r.timestamp_s * time_scale for r in rows]


# ---- synthetic trace -------------------------------------------------------------


@dataclass
class SynthConfig:
    """A chat/RAG service's traffic (token counts at ``block_tokens`` 64):
    sessions start as a Poisson process; each opens with one of a few shared
    system prompts (512 tokens) and a document picked by a Zipf law (768
    tokens), then runs 3-8 turns, a think time apart, each adding a question
    (64-192 tokens) and, for the next turn, the answer (32-128 tokens): the
    context grows from ~1.4k to ~3.5k tokens. Ranges are inclusive, drawn
    uniformly."""

    num_sessions: int = 32
    turns_per_session: tuple[int, int] = (3, 8)
    num_system_prompts: int = 4
    system_prompt_blocks: int = 8
    num_documents: int = 40
    document_blocks: int = 12
    zipf_s: float = 1.1
    question_blocks: tuple[int, int] = (1, 3)
    answer_tokens: tuple[int, int] = (32, 128)
    session_rate_per_s: float = 1.0
    think_time_s: tuple[float, float] = (2.0, 6.0)
    block_tokens: int = 64
    share_prefixes: bool = True  # False: every block of every request unique (control)
    seed: int = 0


def synthesize(cfg: SynthConfig) -> list[dict]:
    """Mooncake-format rows (module doc), sorted by timestamp (ms)."""
    rng = random.Random(cfg.seed)
    next_id = iter(range(10**9))
    systems = [
        [next(next_id) for _ in range(cfg.system_prompt_blocks)]
        for _ in range(cfg.num_system_prompts)
    ]
    docs = [[next(next_id) for _ in range(cfg.document_blocks)] for _ in range(cfg.num_documents)]
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_documents)]
    rows = []
    start_s = 0.0
    for _ in range(cfg.num_sessions):
        start_s += rng.expovariate(cfg.session_rate_per_s)
        context = list(rng.choice(systems)) + list(rng.choices(docs, weights)[0])
        t_s = start_s
        for _ in range(rng.randint(*cfg.turns_per_session)):
            context += [next(next_id) for _ in range(rng.randint(*cfg.question_blocks))]
            output_len = rng.randint(*cfg.answer_tokens)
            rows.append(
                {
                    "timestamp": round(t_s * 1000),
                    "input_length": len(context) * cfg.block_tokens,
                    "output_length": output_len,
                    "hash_ids": (
                        list(context) if cfg.share_prefixes else [next(next_id) for _ in context]
                    ),
                }
            )
            # the next turn carries this answer (rounded up to whole blocks)
            context += [next(next_id) for _ in range(-(-output_len // cfg.block_tokens))]
            t_s += rng.uniform(*cfg.think_time_s)
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def oracle_hit_tokens(rows: list[dict], block_tokens: int) -> int:
    """Prompt tokens some earlier request already computed (every block that
    exists anywhere, nothing evicted): the best any router could hit. Like
    the engines, the block holding a prompt's last token is never a hit."""
    seen: set[int] = set()
    total = 0
    for r in rows:
        ids = r["hash_ids"]
        cap = (r["input_length"] - 1) // block_tokens
        n = 0
        for h in ids[:cap]:
            if h not in seen:
                break
            n += 1
        total += n * block_tokens
        seen.update(ids)
    return total


def main(argv: list[str] | None = None) -> int:
    d = SynthConfig()
    p = argparse.ArgumentParser(
        prog="python -m tandem.cluster.cli.trace_replay",
        description="write a synthetic Mooncake trace",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--num-sessions", type=int, default=d.num_sessions)
    p.add_argument("--block-tokens", type=int, default=d.block_tokens)
    p.add_argument("--session-rate-per-s", type=float, default=d.session_rate_per_s)
    p.add_argument("--no-sharing", action="store_true", help="every block unique")
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    cfg = SynthConfig(
        num_sessions=a.num_sessions,
        block_tokens=a.block_tokens,
        session_rate_per_s=a.session_rate_per_s,
        share_prefixes=not a.no_sharing,
        seed=a.seed,
    )
    with open(a.out, "w") as f:
        for row in synthesize(cfg):
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
