"""benchmarks/simulator.py's served decode sweep: the serving loop's overhead
per decode step by batch, and a prompt step's extra beside decoding streams.

Session 12 found that on this VM a served engine that computes little and
waits often runs each step slower than one the box keeps busy: the probe's
lone stream stepped slower per token than the trace's batched streams, so one
step overhead taken from a lone or paired stream was too big for the trace's
steps. So the probe characterises the served engine the way an ITL-against-
concurrency sweep does: for each batch ``k`` of ``sweep_batches`` it starts
``SWEEP_GROUPS`` groups of ``k`` streams at once (prompts of ``PROBE_PROMPT``
tokens, ``SWEEP_OUTPUT`` answer tokens), ``sweep_gap_s(k)`` apart, and records the
served ITL p50 of those streams; the overhead at ``k`` is that ITL less the
profile's in-process decode step for ``k`` streams at the probe's context.

Beside each group, ``beside_delay_s(k)`` after it (once its prompts are
computed and its streams decode), one lone prompt of the same length and
``BESIDE_OUTPUT`` tokens: the prefill engine's own timing of its step
(``RequestTimings``), against the lone probe's step, is what a prompt step
takes beyond a lone one's with decode work beside it. The number of streams
it met is counted, not assumed: the streams between their second token and
their last output (``decode_spans``) at the middle of its step.

The batches come from the engine and the trace's shape, not from measuring
the trace: the trace's mean decode concurrency is about rate x mean answer x
``ITL_GUESS_S``; the sweep runs powers of two up to twice a busy moment's
(mean + 3 standard deviations of a Poisson count), at least up to 4 and at
most the engine's ``max_num_seqs``.
"""

from __future__ import annotations

import json
import math
import statistics

PROBE_PROMPT = 256  # every probe prompt's tokens
SWEEP_OUTPUT = 96
SWEEP_GROUPS = 6
MIN_BESIDE = 2  # prompts that met the same count of streams, for a point of the curve
BESIDE_OUTPUT = 2  # P computes the prompt; D one more token (a short stream)
ITL_GUESS_S = 0.003  # a tiny engine's served ITL on a CPU box, for the sweep's range only
STREAM, BESIDE = "stream", "beside"


def sweep_batches(rate: float, mean_output: float, max_num_seqs: int) -> list[int]:
    """Powers of two from 1 to the first at or past twice a busy moment's
    decode concurrency (at least 4), capped at ``max_num_seqs``."""
    mean = rate * mean_output * ITL_GUESS_S
    top = max(4, 2 * math.ceil(mean + 3 * math.sqrt(mean)))
    out, k = [], 1
    while k <= max_num_seqs:
        out.append(k)
        if k >= top:
            break
        k *= 2
    return out


def beside_delay_s(k: int) -> float:
    """When the beside prompt follows its group: the group's prompts computed
    (12-25 ms a 256-token prompt served here), their KV handed off (a
    prompt step that overlaps the handoff is not one beside decoding) and a
    few tokens decoded."""
    return 0.05 + 0.02 * k


def sweep_gap_s(k: int) -> float:
    """Between two groups of ``k``: the group's prompts, its ``SWEEP_OUTPUT``
    tokens at a busy box's ITL (6 ms at 8 streams), and a margin, so that a
    group does not decode beside the one before it."""
    return 0.4 + 0.08 * k


def write_sweep(path: str, batches: list[int]) -> list[list]:
    """The sweep's trace (Mooncake JSONL); returns its layout, one ``[k, role]``
    per row (``role`` ``stream`` or ``beside``), which the figures read back."""
    layout, rows = [], []
    t = 0.0
    for k in batches:
        for _ in range(SWEEP_GROUPS):
            for _ in range(k):
                rows.append((t, SWEEP_OUTPUT))
                layout.append([k, STREAM])
            rows.append((t + beside_delay_s(k), BESIDE_OUTPUT))
            layout.append([k, BESIDE])
            t += sweep_gap_s(k)
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    with open(path, "w") as f:
        for i in order:
            ts, out = rows[i]
            row = {"timestamp": round(ts * 1000.0, 3), "input_length": PROBE_PROMPT,
                   "output_length": out, "hash_ids": []}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return [layout[i] for i in order]


def sweep_itls(sweep: dict) -> dict[int, float]:
    """Batch -> served ITL p50 (s) over the streams of its groups."""
    gaps: dict[int, list[float]] = {}
    for (k, role), (_, itls) in zip(sweep["layout"], sweep["per_request"]):
        if role == STREAM:
            gaps.setdefault(k, []).extend(itls)
    return {k: statistics.median(g) / 1000 for k, g in sorted(gaps.items()) if g}


def decode_overheads(profile, sweep: dict, rate: float = 1.0) -> list[list[float]]:
    """``[[k, overhead_s], ...]``: each batch's served ITL (at ``rate`` of its
    solo speed) less the profile's decode step for ``k`` streams at the
    sweep's mean context, at least 0."""
    context = PROBE_PROMPT + SWEEP_OUTPUT // 2
    return [
        [k, max(0.0, itl * rate - profile.decode_s(k, k * context))]
        for k, itl in sweep_itls(sweep).items()
    ]


def decode_spans(sweep: dict) -> list[tuple[float, float]]:
    """Each stream's decoding on the box's one clock: from its second token's
    arrival at the client (the decode engine has its KV and steps it; the
    simulator counts a stream from then) to the gateway's last output. Without
    the client's stamps, from its first token."""
    rows = sweep["rows"]
    sent = {rid: (s, ttft) for rid, s, ttft in sweep.get("stamps", [])}
    spans = []
    for (rid, itls), (_, role) in zip(sweep["per_request"], sweep["layout"]):
        row = rows.get(rid)
        if role != STREAM or row is None or row["end_s"] < 0:
            continue
        start = row["first_token_s"]
        if rid in sent and itls:
            start = sent[rid][0] + sent[rid][1] + itls[0] / 1000
        spans.append((start, row["end_s"]))
    return spans


def beside_steps(sweep: dict) -> list[tuple[int, float]]:
    """Each beside prompt's ``(streams decoding at its step's middle, P's step s)``."""
    ids = [rid for rid, _ in sweep["per_request"]]
    rows = sweep["rows"]
    spans = decode_spans(sweep)
    out = []
    for rid, (_, role) in zip(ids, sweep["layout"]):
        row = rows.get(rid)
        if role != BESIDE or row is None or row["scheduled_s"] < 0 or row["p_first_token_s"] < 0:
            continue
        # P's offsets on the gateway's clock: anchored at the receipt of its output
        mid = row["first_token_s"] - row["finished_s"]
        mid += (row["scheduled_s"] + row["p_first_token_s"]) / 2
        n = sum(1 for start, end in spans if start <= mid <= end)
        out.append((n, row["p_first_token_s"] - row["scheduled_s"]))
    return out


def beside_extras(sweep: dict, lone_step_s: float, rate: float = 1.0) -> list[list[float]]:
    """``[[streams, extra_s], ...]`` from 0 (0 s: the lone figure is
    ``prefill_overhead_s``): per count of decoding streams met, the median
    beside step (at ``rate`` of its solo speed) less the lone probe's, at
    least 0. Prompts that met no stream are left out, and a count fewer than
    ``MIN_BESIDE`` prompts met (one prompt's step on a shared box is noise)."""
    by_n: dict[int, list[float]] = {}
    for n, step_s in beside_steps(sweep):
        if n > 0:
            by_n.setdefault(n, []).append(step_s)
    return [[0, 0.0]] + [
        [n, max(0.0, (statistics.median(xs) - lone_step_s) * rate)]
        for n, xs in sorted(by_n.items())
        if len(xs) >= MIN_BESIDE
    ]


def median_curve(curves: list[list[list[float]]]) -> list[list[float]]:
    """Several probes' curves as one: at every count any of them has, the
    median of the values of those that have it."""
    at: dict[float, list[float]] = {}
    for curve in curves:
        for x, y in curve:
            at.setdefault(x, []).append(y)
    return [[x, statistics.median(ys)] for x, ys in sorted(at.items())]


def ms_curve(value) -> str:
    """A service figure for the printout: ``1.234 ms`` or ``1: 1.23, 4: 0.80 ms``."""
    if isinstance(value, list):
        return ", ".join(f"{x:g}: {y * 1000:.2f}" for x, y in value) + " ms"
    return f"{value * 1000:.3f} ms"


def sweep_table(profile, probes: list[dict]) -> str:
    """Per batch: the probes' served ITL p50 (median, min-max), the profile's
    step and the overhead; per count of streams met: the beside prompts'
    P step (median over every probe's prompts) against the lone probe's."""
    from benchmarks._sim_figures import probe_parts

    sweeps = [pr["sweep"] for pr in probes if "sweep" in pr]
    context = PROBE_PROMPT + SWEEP_OUTPUT // 2
    itls: dict[int, list[float]] = {}
    for sw in sweeps:
        for k, itl in sweep_itls(sw).items():
            itls.setdefault(k, []).append(itl * 1000)
    lines = ["| batch | served ITL p50 ms (min-max) | profile step ms | overhead ms |",
             "|---:|---:|---:|---:|"]  # fmt: skip
    for k, xs in sorted(itls.items()):
        med, step = statistics.median(xs), profile.decode_s(k, k * context) * 1000
        lines.append(f"| {k} | {med:.2f} ({min(xs):.2f}-{max(xs):.2f}) | {step:.2f} "
                     f"| {med - step:+.2f} |")  # fmt: skip
    lone = [parts[1] * 1000 for pr in probes if (parts := probe_parts(pr)) is not None]
    steps: dict[int, list[float]] = {}
    for sw in sweeps:
        for n, s in beside_steps(sw):
            steps.setdefault(n, []).append(s * 1000)
    if lone and steps:
        base = statistics.median(lone)
        lines += ["", f"prompt step beside decoding (P's own timing; lone probe {base:.2f} ms):",
                  "| streams met | prompts | P step ms (median) | over lone |",
                  "|---:|---:|---:|---:|"]  # fmt: skip
        for n, xs in sorted(steps.items()):
            med = statistics.median(xs)
            lines.append(f"| {n} | {len(xs)} | {med:.2f} | {med - base:+.2f} |")
    return "\n".join(lines)


def print_sweep(engine_only: dict, probes: list[dict], where: str = "") -> None:
    from tandem.cluster.planner.profile import Profile

    if any("sweep" in pr for pr in probes):
        on = f" on {where}" if where else ""
        print(f"\nserved decode sweep{on} (benchmarks/_sim_sweep.py; medians over the rounds' "
              "probes):")  # fmt: skip
        print(sweep_table(Profile.from_json(engine_only), probes))
