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
