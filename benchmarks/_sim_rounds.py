"""benchmarks/simulator.py, round by round: each round's configurations
predicted from that round's own profile and probe.

The other ways predict once, from the median of the rounds' profiles and
probes, and compare that one prediction with each round's measurement. On
this VM a whole round can run 25% slower than the next (session 12's quiet
run: every configuration's ITL in round 1 above rounds 2 and 3), and then
the error of a round is the box's minute, not the model. Here the inputs of
a prediction were measured minutes before the runs it is compared with, on
the same box state; nothing is taken from the runs themselves. The figure is
the median over the rounds of each round's error. With ``--probe-each``
(_sim_own.py) the table is printed twice: round r's configurations from round
r's probe of the first configuration, and each from round r's probe of its
own service.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable

from benchmarks._sim_figures import host_figures
from benchmarks._sim_tables import METRICS, TARGET, rel


def round_profiles(
    tmp: str,
    engine_only: dict,
    profiles: list[dict],
    probes_of: dict[str, list[dict]],
    tag: str = "",
) -> dict[tuple[int, str], str]:
    """Per (round, configuration), the profile file of the + shared cores way
    from that round's engine profile (the run's profile when rounds had none
    of their own) and that round's probe of the configuration (``probes_of``,
    _sim_own.per_config: the first configuration's for all, or each one's
    own). Configurations that share a round's probe share its file."""
    paths: dict[tuple[int, str], str] = {}
    written: dict[tuple[int, int], str] = {}
    for name, probes in probes_of.items():
        for r, probe in enumerate(probes):
            key = (r, id(probe))
            if key not in written:
                base = profiles[r] if r < len(profiles) else engine_only
                path = os.path.join(tmp, f"profile-round-{r + 1}-{len(written)}{tag}-own.json")
                with open(path, "w") as f:
                    json.dump(host_figures(base, probe, None), f)
                written[key] = path
            paths[r, name] = written[key]
    return paths


def round_errors(
    reals: dict[str, list[dict]], sims: dict[tuple[int, str], dict]
) -> dict[tuple[str, str], list[float]]:
    """(configuration, metric) -> each round's p50 error of its own prediction
    (``sims[round, configuration]``) against its own measurement."""
    out: dict[tuple[str, str], list[float]] = {}
    for name, runs in reals.items():
        for key, _ in METRICS:
            out[name, key] = [
                rel(sims[r, name][key]["p50"], run[key]["p50"]) for r, run in enumerate(runs)
            ]
    return out


def rounds_own_table(errors: dict[tuple[str, str], list[float]]) -> tuple[str, float]:
    """The table of per-round errors and their median, and the worst |median|."""
    lines = [
        "| config | metric | error per round | median error |",
        "|---|---|---|---:|",
    ]
    worst = 0.0
    labels = dict(METRICS)
    for (name, key), errs in errors.items():
        med = statistics.median(errs)
        worst = max(worst, abs(med))
        mark = " **over**" if abs(med) > TARGET else ""
        each = " ".join(f"{e:+.0%}" for e in errs)
        lines.append(f"| {name} | {labels[key]} p50 | {each} | {med:+.1%}{mark} |")
    return "\n".join(lines), worst


def predict_by_round(
    tmp: str,
    engine_only: dict,
    profiles: list[dict],
    probes: list[dict] | dict[str, list[dict]],
    reals: dict[str, list[dict]],
    simulate: Callable[[str, str], dict],
    tag: str = "",
) -> tuple[str, float] | None:
    """``simulate(profile_path, configuration)`` -> summary. ``probes`` a list:
    round r's probe for every configuration; a dict: each configuration's own
    (``--probe-each``). None when a configuration has not one probe (with its
    CPU accounting) per round. A run given ``--profile`` uses that engine
    profile in every round, with each round's probe."""
    from benchmarks._sim_own import per_config

    rounds = len(next(iter(reals.values())))
    probes_of = per_config(probes, reals)
    for prs in probes_of.values():
        if len(prs) != rounds or not all("cpu" in pr for pr in prs):
            return None
    paths = round_profiles(tmp, engine_only, profiles, probes_of, tag)
    sims = {(r, n): simulate(paths[r, n], n) for r in range(rounds) for n in reals}
    return rounds_own_table(round_errors(reals, sims))


def print_by_round(by_round: tuple[str, float] | None, label: str = "probe") -> None:
    if by_round is None:
        return
    text, worst = by_round
    verdict = "holds" if worst <= TARGET else "does not hold"
    print(f"\nround by round (each round's own profile and {label}, + shared cores; "
          "_sim_rounds.py):")  # fmt: skip
    print(text)
    print(f"worst median of the rounds' p50 errors ({label}): {worst:.1%}: {TARGET:.0%} {verdict}")
