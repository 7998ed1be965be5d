"""benchmarks/simulator.py's tables: predicted against measured, per way."""

from __future__ import annotations

TARGET = 0.15  # issue 28: within 15% on TTFT p50 and ITL p50


def rel(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def table(rows: list[tuple[str, dict, dict]]) -> str:
    lines = [
        "| config | metric | predicted ms | measured ms | error |",
        "|---|---|---:|---:|---:|",
    ]
    for name, sim, real in rows:
        for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
            for p in ("p50", "p99"):
                err = rel(sim[key][p], real[key][p])
                mark = " **over**" if p == "p50" and abs(err) > TARGET else ""
                lines.append(
                    f"| {name} | {label} {p} | {sim[key][p]:.2f} | {real[key][p]:.2f} "
                    f"| {err:+.1%}{mark} |"
                )
    return "\n".join(lines)


def side_by_side(rows: dict[str, list[tuple[str, dict, dict]]]) -> str:
    """One row per configuration and p50, one error column per way."""
    ways = list(rows)
    lines = [
        "| config | metric | measured ms | " + " | ".join(ways) + " |",
        "|---|---|---:|" + "---:|" * len(ways),
    ]
    for i, (name, _, real) in enumerate(rows[ways[0]]):
        for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
            errs = [rel(rows[w][i][1][key]["p50"], real[key]["p50"]) for w in ways]
            cells = " | ".join(f"{e:+.1%}" for e in errs)
            lines.append(f"| {name} | {label} p50 | {real[key]['p50']:.2f} | {cells} |")
    return "\n".join(lines)


METRICS = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"))


def median_run(runs: list[dict]) -> dict:
    """One configuration's rounds as one summary: each percentile the median of
    the rounds' values (``table`` and ``side_by_side`` read it like a run)."""
    import statistics

    return {
        key: {p: statistics.median(r[key][p] for r in runs) for p in ("p50", "p99")}
        for key, _ in METRICS
    }


def spread_table(rows: list[tuple[str, dict, list[dict]]]) -> str:
    """Predicted against the median of the rounds, with the rounds' min-max and
    each round's own error (its sign, round by round, shows a bias)."""
    lines = [
        "| config | metric | predicted ms | measured ms, median | min-max | error of median "
        "| error per round |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name, sim, runs in rows:
        med = median_run(runs)
        for key, label in METRICS:
            for p in ("p50", "p99"):
                xs = [r[key][p] for r in runs]
                err = rel(sim[key][p], med[key][p])
                mark = " **over**" if p == "p50" and abs(err) > TARGET else ""
                each = " ".join(f"{rel(sim[key][p], x):+.0%}" for x in xs)
                lines.append(
                    f"| {name} | {label} {p} | {sim[key][p]:.2f} | {med[key][p]:.2f} "
                    f"| {min(xs):.2f}-{max(xs):.2f} | {err:+.1%}{mark} | {each} |"
                )
    return "\n".join(lines)


def rounds_table(reals: dict[str, list[dict]], loads: dict[str, list[float]]) -> str:
    """The measured p50s round by round (interleaved: round 1 ran every
    configuration before round 2 began), with the load average after each."""
    names = list(reals)
    lines = [
        "| round | " + " | ".join(f"{n} TTFT / ITL p50 (load)" for n in names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for i in range(max(len(v) for v in reals.values())):
        cells = []
        for n in names:
            r = reals[n][i]
            cells.append(
                f"{r['ttft_ms']['p50']:.2f} / {r['itl_ms']['p50']:.2f} ({loads[n][i]:.1f})"
            )
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
