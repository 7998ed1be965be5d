"""benchmarks/simulator.py's idle-gap probe: a prompt step's extra after its
prefill engine sat idle.

Session 12 measured on this VM, in process, that a 256-token prefill took
11.5 ms back to back, 15.6 ms after 0.4 s of sleep and 9.1 ms after 0.4 s of
spinning; session 13 saw the served prefill step of 2P1D (each prefill engine
gets half the prompts and waits longer between them) run 25 ms against the
simulator's 19. So the probe sends lone prompts of ``PROBE_PROMPT`` tokens
(``IDLE_OUTPUT`` tokens each: P computes the prompt, D one token) after
controlled pauses, each of ``IDLE_GAPS_S`` once per repeat, in an order turned
by one place a repeat (interleaved, not grouped: a slow minute of the box
lands on every pause alike). The pause before a prompt is the nominal one
plus ``STEP_GUESS_S`` (a served prompt step and its path here), so that the
previous prompt is done when it starts.

What counts is not the nominal pause but the prefill engine's own idle time
before the step: from P's ``RequestTimings`` every prompt step's start and
end on the gateway's clock (``p_steps``), the idle time being a step's start
less the end of that engine's step before it. Per nominal pause the median
idle time and the median step (at ``rate`` of their solo speed) give one
point. Five prompts a pause are few on a shared box (one slow minute moves a
median), so the steps are made non-decreasing in the idle time (pool adjacent
violators, ``monotone``: a longer idle is taken as never faster) before the
curve's values are taken, each point's step less the shortest pause's
(``idle_extras``): what the profile's ``service.prefill_after_idle_s`` holds.
The lone probe's prompts (0.4 s apart) carry that extra at their own idle
time, so ``prefill_overhead_s`` is taken at no idle time: each lone and idle
prompt's step less the curve at its own idle time, the median of them all
(``base_step_s``, ``_sim_figures._service``); the beside prompts' base is
that step plus the curve at their idle time.

The decode engine's side (its first step after the handoff, after its own
idle time) is printed, not modelled (``d_first_steps``).
"""

from __future__ import annotations

import json
import statistics

from benchmarks._sim_sweep import PROBE_PROMPT

# up to the idle a prefill engine of 2P1D sees at the trace's 2 req/s (1 s on average)
IDLE_GAPS_S = (0.02, 0.15, 0.5, 1.5)
IDLE_REPEATS = 5
IDLE_OUTPUT = 2
STEP_GUESS_S = 0.025
LEAD = "lead"  # the first prompt: its idle time is the pass before's


def idle_order(repeats: int = IDLE_REPEATS) -> list[float]:
    """The nominal pauses in sending order: every pause once a repeat, the
    order turned by one place each repeat."""
    gaps = list(IDLE_GAPS_S)
    out: list[float] = []
    for r in range(repeats):
        k = r % len(gaps)
        out += gaps[k:] + gaps[:k]
    return out


def write_idle(path: str, repeats: int = IDLE_REPEATS) -> list:
    """The idle probe's trace (Mooncake JSONL); returns its layout, one entry
    per row: ``LEAD`` or the nominal pause (s) before it."""
    layout: list = [LEAD]
    times = [0.0]
    for gap in idle_order(repeats):
        times.append(times[-1] + STEP_GUESS_S + gap)
        layout.append(gap)
    with open(path, "w") as f:
        for t in times:
            row = {"timestamp": round(t * 1000.0, 3), "input_length": PROBE_PROMPT,
                   "output_length": IDLE_OUTPUT, "hash_ids": []}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return layout


def p_steps(rows: dict) -> dict[str, tuple[str, float, float, float]]:
    """Request id -> ``(prefill engine, step start, step end, idle before)`` on
    the gateway's clock: P's offsets anchored at the gateway's receipt of its
    output; the idle time since the end of that engine's step before (``nan``
    for an engine's first step in ``rows``). Steps that computed several
    prompts at once count as one."""
    steps = []
    for rid, row in rows.items():
        if row.get("scheduled_s", -1) < 0 or row.get("p_first_token_s", -1) < 0:
            continue
        anchor = row["first_token_s"] - row["finished_s"]
        eng = row.get("p_engine", "")
        steps.append((eng, anchor + row["scheduled_s"], anchor + row["p_first_token_s"], rid))
    out = {}
    last: dict[str, tuple[float, float]] = {}  # per engine: the latest step's end, its idle
    for eng, start, end, rid in sorted(steps, key=lambda s: (s[0], s[1])):
        prev = last.get(eng)
        if prev is None:
            idle = float("nan")
        elif start < prev[0]:  # in the step before (prompts computed together): its idle
            idle = prev[1]
        else:
            idle = start - prev[0]
        out[rid] = (eng, start, end, idle)
        last[eng] = (max(end, prev[0]) if prev is not None else end, idle)
    return out


def lone_idle_s(probe: dict) -> float | None:
    """The lone probe's prompts' median idle time before their prefill step."""
    if "rows" not in probe:
        return None
    xs = [s[3] for s in p_steps(probe["rows"]).values() if s[3] == s[3]]
    return statistics.median(xs) if xs else None


def idle_points(idle: dict) -> list[tuple[float, float, float, int]]:
    """Per nominal pause: ``(pause, median idle s, median P step s, prompts)``."""
    steps = p_steps(idle["rows"])
    by_gap: dict[float, list[tuple[float, float]]] = {}
    for (rid, _), gap in zip(idle["per_request"], idle["layout"]):
        s = steps.get(rid)
        if gap == LEAD or s is None or s[3] != s[3]:
            continue
        by_gap.setdefault(gap, []).append((s[3], s[2] - s[1]))
    return [
        (g, statistics.median(i for i, _ in xs), statistics.median(st for _, st in xs), len(xs))
        for g, xs in sorted(by_gap.items())
    ]


def idle_extras(idle: dict, rate: float = 1.0) -> list[list[float]]:
    """``[[idle_s, extra_s], ...]``: per nominal pause, its median idle time and
    its median step (at ``rate`` of solo speed) less the shortest pause's, at
    least 0; the first point is 0 (back to back is the base)."""
    points = idle_points(idle)
    if len(points) < 2:
        return []
    steps = monotone([s for _, _, s, _ in points])
    out: list[list[float]] = []
    for (_, idle_s, _, _), step_s in zip(points, steps):
        if out and idle_s <= out[-1][0]:
            continue  # the curve's counts must increase
        out.append([idle_s, max(0.0, (step_s - steps[0]) * rate)])
    out[0][1] = 0.0
    return out


def monotone(ys: list[float]) -> list[float]:
    """The non-decreasing sequence nearest ``ys`` in squares (pool adjacent
    violators: a run that falls is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return [total / n for total, n in blocks for _ in range(int(n))]


def d_first_steps(idle: dict) -> list[tuple[float, float, float, int]]:
    """The decode engine's side, per nominal pause: ``(pause, median idle s
    of D before the step, median first step s, prompts)``: the step is D's
    first token less the end of its KV read (the loop's notice of the read
    and the step computing the first token's KV); D's idle time is since its
    previous request's last output."""
    rows = idle["rows"]
    ends, firsts = [], {}
    for rid, row in rows.items():
        if row.get("d_finished_s", -1) < 0 or row.get("d_first_token_s", -1) < 0:
            continue
        if row.get("d_kv_load_end_s", -1) < 0:
            continue
        anchor = row["d_received_s"] - row["d_finished_s"]
        start, first = anchor + row["d_kv_load_end_s"], anchor + row["d_first_token_s"]
        ends.append(anchor + row["d_finished_s"])
        firsts[rid] = (start, first)
    by_gap: dict[float, list[tuple[float, float]]] = {}
    for (rid, _), gap in zip(idle["per_request"], idle["layout"]):
        if gap == LEAD or rid not in firsts:
            continue
        start, first = firsts[rid]
        before = [e for e in ends if e <= start]
        if before:
            by_gap.setdefault(gap, []).append((start - max(before), first - start))
    return [
        (g, statistics.median(i for i, _ in xs), statistics.median(s for _, s in xs), len(xs))
        for g, xs in sorted(by_gap.items())
    ]


def trace_idle_rows(profile, rows: dict, alone: bool = False) -> list[tuple[float, float]]:
    """The trace's own prompt steps: ``(idle s before, step less the profile's
    step for that prompt, s)``, engine by engine. ``alone``: only the steps
    that met no decoding stream (another request between its first token and
    its last output at the step's middle), which the beside term covers: a
    prompt that follows another closely also meets its stream."""
    spans = [(r["first_token_s"], r["end_s"]) for r in rows.values() if r.get("end_s", -1) >= 0]
    out = []
    for rid, (_, start, end, idle) in p_steps(rows).items():
        mid = (start + end) / 2
        if alone and any(a <= mid <= b for a, b in spans):
            continue
        if idle == idle:
            out.append((idle, end - start - profile.prefill_s(rows[rid]["prompt_tokens"])))
    return out


BUCKETS = ((0.0, 0.05), (0.05, 0.2), (0.2, 0.6), (0.6, 1.5), (1.5, float("inf")))


def _bucket(idle_s: float) -> int:
    return next(i for i, (lo, hi) in enumerate(BUCKETS) if lo <= idle_s < hi)


def idle_table(profile, reals: dict, probes: list[dict]) -> str:
    """Prompt steps over the profile's step by the prefill engine's idle time
    before them (ms, median (steps)): the trace's per configuration, pooled
    over the rounds, and the idle probe's (256-token prompts)."""
    head = " | ".join(f"{lo:g}-{hi:g} s" for lo, hi in BUCKETS)
    lines = [f"| steps | {head} |", "|---|" + "---:|" * len(BUCKETS)]

    def row(label: str, pairs: list[tuple[float, float]]) -> None:
        cells: list[list[float]] = [[] for _ in BUCKETS]
        for idle, extra in pairs:
            cells[_bucket(idle)].append(extra * 1000)
        text = [f"{statistics.median(c):+.2f} ({len(c)})" if c else "-" for c in cells]
        lines.append(f"| {label} | " + " | ".join(text) + " |")

    for name, runs in reals.items():
        for alone in (False, True):
            pairs = [
                x for r in runs if "rows" in r for x in trace_idle_rows(profile, r["rows"], alone)
            ]
            if pairs:
                row(f"trace {name}" + (", no stream decoding" if alone else ""), pairs)
    probe_pairs = []
    base = profile.prefill_s(PROBE_PROMPT)
    for pr in probes:
        idle = pr.get("idle")
        if idle is None:
            continue
        steps = p_steps(idle["rows"])
        for (rid, _), gap in zip(idle["per_request"], idle["layout"]):
            s = steps.get(rid)
            if gap != LEAD and s is not None and s[3] == s[3]:
                probe_pairs.append((s[3], s[2] - s[1] - base))
    if probe_pairs:
        row("idle probe", probe_pairs)
    return "\n".join(lines)


def print_idle(profile_json: dict, reals: dict, probes: list[dict]) -> None:
    from tandem.cluster.planner.profile import Profile

    idles = [pr["idle"] for pr in probes if "idle" in pr]
    if not idles:
        return
    print("\nidle-gap probe (benchmarks/_sim_idle.py; per round's probe: pause s -> P idle ms, "
          "P step ms (n); D idle ms, D first step ms):")  # fmt: skip
    for r, idle in enumerate(idles, 1):
        ps = {g: (i, s, n) for g, i, s, n in idle_points(idle)}
        ds = {g: (i, s) for g, i, s, _ in d_first_steps(idle)}
        cells = []
        for g in sorted({g for g in idle["layout"] if g != LEAD}):
            p = ps.get(g)
            d = ds.get(g)
            txt = f"{g:g}: P {p[0] * 1000:.0f}, {p[1] * 1000:.2f} ({p[2]})" if p else f"{g:g}: -"
            if d:
                txt += f"; D {d[0] * 1000:.0f}, {d[1] * 1000:.2f}"
            cells.append(txt)
        print(f"  probe {r}: " + " | ".join(cells))
    print("\nprompt steps over the profile's step by the prefill engine's idle time before "
          "them (ms, median (steps)):")  # fmt: skip
    print(idle_table(Profile.from_json(profile_json), reals, probes))


def beside_idle_s(sweep: dict) -> float | None:
    """The sweep's beside prompts' median idle time before their step (their
    group's prompts were computed just before)."""
    from benchmarks._sim_sweep import BESIDE

    steps = p_steps(sweep["rows"])
    xs = [
        s[3]
        for (rid, _), (_, role) in zip(sweep["per_request"], sweep["layout"])
        if role == BESIDE and (s := steps.get(rid)) is not None and s[3] == s[3]
    ]
    return statistics.median(xs) if xs else None


def median_points(curves: list[list[list[float]]]) -> list[list[float]]:
    """Several probes' idle curves as one, point by point (each has a point
    per nominal pause, at its own measured idle time): the medians of the
    idle times and of the extras. Curves of another length are left out."""
    if not curves:
        return []
    n = statistics.median_low([len(c) for c in curves])
    same = [c for c in curves if len(c) == n]
    out = [[statistics.median(c[i][0] for c in same), statistics.median(c[i][1] for c in same)]
           for i in range(n)]  # fmt: skip
    return [pt for i, pt in enumerate(out) if i == 0 or pt[0] > out[i - 1][0]]


def base_step_s(probe: dict, curve: list, rate: float = 1.0) -> float | None:
    """A served 256-token prompt step at no idle time (solo seconds), pooled:
    the median over the lone pass's prompts and the idle probe's of each
    one's step (at ``rate`` of solo speed) less the curve at its own idle
    time. Twice the prompts of the lone pass alone, spread over more of the
    probe's minute (one probe's lone steps moved with the box's minute)."""
    from tandem.cluster.planner.service_curve import curve_at

    xs = []
    for run in (probe, probe.get("idle") or {}):
        if "rows" not in run:
            continue
        for _, start, end, idle in p_steps(run["rows"]).values():
            if idle == idle:
                xs.append((end - start) * rate - curve_at(curve, idle))
    return statistics.median(xs) if xs else None
