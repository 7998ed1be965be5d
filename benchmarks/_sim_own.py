"""benchmarks/simulator.py ``--probe-each``: every configuration's service
figures from probes of its own service.

Without the flag the probe runs on the first configuration (1P1D) once a
round, and the median over the rounds' probes is every configuration's
``service`` section. Session 14 found the prompt step 3.7-6 ms slower in
1P2D and 2P1D (a third engine process on two cores, with both cores busy),
which a 1P1D probe cannot see. With the flag every configuration runs the
same probe on its own service just before its trace, every round; a
configuration is predicted from the median over the rounds of its own
probes' figures, and the first configuration's probes alone still give the
way without the flag, so both are printed from one run.

A run's probes are kept as ``{configuration: [probe per round]}`` (a
configuration without a probe in that round has none in its list). A run
kept by ``--save`` before the flag has ``probes``, a list (the first
configuration's); a run kept with it has ``probes_each`` too
(``probe_sets``).
"""

from __future__ import annotations

from collections import Counter

PROBE_PARTS = ("lone", "cached", "sweep", "idle")


def per_config(probes: list[dict] | dict[str, list[dict]], names) -> dict[str, list[dict]]:
    """Configuration -> the probes its figures come from: a list is the same
    probes for every configuration (the first configuration's, without
    ``--probe-each``), a dict is each configuration's own."""
    if isinstance(probes, dict):
        missing = [n for n in names if n not in probes]
        if missing:
            raise ValueError(f"no probes for {', '.join(missing)}")
        return {n: probes[n] for n in names}
    return {n: probes for n in names}


def probe_sets(kept: dict) -> tuple[list[dict], dict[str, list[dict]] | None]:
    """From a run ``--save`` kept: the first configuration's probes (every
    run has them) and each configuration's own (None for a run kept without
    ``--probe-each``)."""
    each = kept.get("probes_each")
    return kept["probes"], ({n: each[n] for n in kept["real"]} if each else None)


def saved_probes(probes: list[dict], own: dict[str, list[dict]] | None) -> dict:
    """The probes' part of the ``--save`` file: ``probes`` the first
    configuration's list as before (older readers predict from it), and with
    ``own`` every configuration's own under ``probes_each`` (the first
    configuration's again: the file is read the same way for every one)."""
    return {"probes": probes, **({"probes_each": own} if own else {})}


def engines_met(probe: dict) -> dict[str, dict[str, Counter]]:
    """Per part of the probe (``lone``, ``cached``, ``sweep``, ``idle``): how
    many of its requests each prefill engine (``p_engine``) and each decode
    engine (``d_engine``) served, from the gateway's rows (runs kept before
    the rows named the decode engine: no decode counts)."""
    out: dict[str, dict[str, Counter]] = {}
    for part in PROBE_PARTS:
        run = probe if part == "lone" else probe.get(part) or {}
        rows = run.get("rows") if isinstance(run, dict) else None
        if not rows:
            continue
        out[part] = {
            "prefill": Counter(r["p_engine"] for r in rows.values() if r.get("p_engine")),
            "decode": Counter(r["d_engine"] for r in rows.values() if r.get("d_engine")),
        }
    return out


def routing_line(probes: list[dict]) -> str:
    """Which engines the probes' requests met, summed over the rounds:
    ``lone P prefill-0 48; sweep P prefill-0 40 prefill-1 8, D decode-0 48``."""
    total: dict[str, dict[str, Counter]] = {}
    for pr in probes:
        for part, roles in engines_met(pr).items():
            for role, counts in roles.items():
                total.setdefault(part, {}).setdefault(role, Counter()).update(counts)
    cells = []
    for part in PROBE_PARTS:
        if part not in total:
            continue
        text = []
        for role, short in (("prefill", "P"), ("decode", "D")):
            counts = total[part].get(role)
            if counts:
                text.append(f"{short} " + " ".join(f"{e} {n}" for e, n in sorted(counts.items())))
        if text:
            cells.append(f"{part} " + ", ".join(text))
    return "; ".join(cells) or "-"
