"""benchmarks/simulator.py's measured inputs: the profile's ``service`` and
``host`` sections from probes of lone requests on a served 1P1D (with
``--probe-each``, on each configuration's own service: _sim_own.py).

Every round of the benchmark probes once (per configuration with
``--probe-each``); the figures the simulator is given are the median of each
figure over the rounds' probes (``median_figures``), so one probe that met a
busy minute of the shared box moves nothing much.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable

from benchmarks._sim_idle import base_step_s, beside_idle_s, idle_extras, median_points
from benchmarks._sim_sweep import PROBE_PROMPT, beside_extras, decode_overheads, median_curve

PROBE_OUTPUT = 32
ENGINE_THREADS = 1  # the served and the profiled engines' torch threads


def write_probe(path: str, num_requests: int, gap_s: float, together: int = 1) -> None:
    """Requests ``gap_s`` apart, ``together`` at a time (1: lone, none overlaps
    another): the serving path's figures."""
    with open(path, "w") as f:
        for i in range(num_requests):
            row = {"timestamp": i // together * gap_s * 1000.0, "input_length": PROBE_PROMPT,
                   "output_length": PROBE_OUTPUT, "hash_ids": []}  # fmt: skip
            f.write(json.dumps(row) + "\n")


def probe_prefill(profile: dict, probe: dict) -> tuple[float, int]:
    """The TTFT p50 (s) the path's latency is taken from, and the prompt tokens
    its prefill computed. With ``probe["cached"]`` (the same lone requests
    again: every prompt's full blocks are in the prefill engine's cache, so
    only the last block's tokens are computed) the TTFT is mostly the path's,
    and the few ms of prefill it still holds are what a core's wait can
    stretch; without it (runs kept before session 11) the whole 256-token
    prefill is in it, and every ms that prefill waited for a core on a busy
    box would land in the latency the simulator adds to every request."""
    cached = probe.get("cached")
    if cached is None:
        return probe["ttft_ms"]["p50"] / 1000, PROBE_PROMPT
    block = int(profile.get("scheduler", {}).get("block_size", 16))
    computed = PROBE_PROMPT - (PROBE_PROMPT - 1) // block * block
    return cached["ttft_ms"]["p50"] / 1000, computed


def probe_decode(p: object, probe: dict) -> tuple[float, float]:
    """The ITL p50 (s) the step overhead is taken from, and the profile's decode
    step under it. With ``probe["paired"]`` (the probe's requests two at a
    time) it is a batch-2 step's: on a quiet box a lone stream's ITL was 30%
    above the trace's streams' on the same service (session 11,
    docs/benchmarks.md), so an overhead from lone requests is more than the
    trace's steps carry. Without it (runs kept before), the lone requests'."""
    context = PROBE_PROMPT + PROBE_OUTPUT // 2
    paired = probe.get("paired")
    if paired is None:
        return probe["itl_ms"]["p50"] / 1000, p.decode_s(1, context)
    return paired["itl_ms"]["p50"] / 1000, p.decode_s(2, 2 * context)


def probe_parts(probe: dict) -> tuple[float, float] | None:
    """From the probe's TTFT breakdown (benchmarks/_sim_breakdown.py; runs kept
    before session 12 have none: None): the serving path's latency (s), the
    median over the cached pass's requests (the lone pass's without one) of
    every part but the prefill engine's queue and step, and the lone
    requests' prefill step (s), P's own timing of the step that computed a
    whole 256-token prompt."""
    from benchmarks._sim_breakdown import SIM_PARTS, run_parts

    if "rows" not in probe:
        return None
    lone = run_parts(probe["stamps"], probe["rows"])
    cached = probe.get("cached") or {}
    path = run_parts(cached["stamps"], cached["rows"]) if "rows" in cached else lone
    if not lone["n"] or not path["n"]:
        return None
    return sum(path[k] for k in SIM_PARTS["path"]) / 1000, lone["p_step"] / 1000


def service_figures(profile: dict, probe: dict) -> dict:
    """``profile`` (JSON) with its ``service`` section from the probe's medians:
    each ITL is one decode step (batch 2 with the paired pass, ``probe_decode``)
    plus the loop's overhead. With the probe's TTFT breakdown (``probe_parts``)
    the path's latency is what the timestamps measure around the prefill
    engine's queue and step, and ``prefill_overhead_s`` what the lone
    requests' served prefill step took beyond the profile's step and that
    overhead (session 12: 6-8 ms on this box, the engine coming to each
    prompt from idle). Without one (runs kept before) a lone request's TTFT
    (the cached pass's, ``probe_prefill``) is the path's latency plus one
    prefill step (with that overhead). Not fitted to the trace: the probe is
    its own run."""
    from tandem.cluster.planner.profile import Profile

    return {**profile, "service": _service(Profile.from_json(profile), profile, probe, 1.0)}


def _service(p, profile: dict, probe: dict, rate: float) -> dict:
    """The ``service`` section from one probe, its times taken at ``rate`` of
    their solo speed (1: no contention term). With the probe's decode sweep
    (``probe["sweep"]``, _sim_sweep.py) the step overhead is a curve by batch
    and the prompt step gains its extra beside decoding streams; without one
    (runs kept before session 13) one overhead from the paired or lone pass."""
    sweep = probe.get("sweep")
    if sweep is not None:
        curve = decode_overheads(p, sweep, rate)
        overhead_s: float | list = curve
        lone = dict(curve).get(1, curve[0][1])  # what the lone prompt step carries
    else:
        itl_s, step_s = probe_decode(p, probe)
        overhead_s = lone = max(0.0, itl_s * rate - step_s)
    parts = probe_parts(probe)
    service: dict = {"step_overhead_s": overhead_s}
    if parts is not None:  # the path as measured; the served step's solo excess
        latency, served_step_s = parts
        # with the idle-gap probe (_sim_idle.py): each lone prompt's step carries the
        # extra at its own idle time, so the overhead is taken at no idle time, from
        # the lone and the idle probe's prompts together (base_step_s)
        idle = idle_extras(probe["idle"], rate) if "idle" in probe else []
        base = base_step_s(probe, idle, rate) if idle else None
        if base is None:
            base, idle = served_step_s * rate, []
        extra = max(0.0, base - p.prefill_s(PROBE_PROMPT) - lone)
        if idle:
            service["prefill_after_idle_s"] = idle
        if sweep is not None:
            # the beside prompts follow their group's prompts closely: the base
            # they are set against carries the extra at their own idle time
            at_beside = _idle_at(idle, beside_idle_s(sweep))
            service["prefill_beside_decode_s"] = beside_extras(
                sweep, (base + at_beside) / rate, rate
            )
    else:
        ttft_s, computed = probe_prefill(profile, probe)
        step = (p.prefill_s(computed) + lone) / rate
        latency, extra = max(0.0, ttft_s - step), 0.0
    return {"request_latency_s": latency, **service, "prefill_overhead_s": extra}


def _idle_at(curve: list, idle_s: float | None) -> float:
    """The idle curve at ``idle_s`` (0 without either)."""
    from tandem.cluster.planner.service_curve import curve_at

    return curve_at(curve, idle_s) if curve and idle_s is not None else 0.0


def host_figures(profile: dict, probe: dict, background_cores: float | None) -> dict:
    """``profile`` (JSON) with a ``host`` section and its ``service`` figures
    taken apart from the contention the probe ran under.

    - ``cores`` and ``engine_threads``: what ``tandem profile --shared-cores``
      wrote (this box's cores, ``os.sched_getaffinity``; the profiled engine's
      torch threads).
    - ``cpu_per_token_s``: the serving path's CPU per streamed token, from the
      probe: the gateway's process (this one: ``time.process_time``) and the
      client's streaming loop, over the probe's output tokens, less what the
      gateway's process burns idle (measured for ``IDLE_WINDOW_S`` before the
      probe). It includes the per-request work (HTTP, tokenizing) spread over
      the probe's 32 tokens.
    - ``background_cores``: what the rest of the box (other sessions' jobs,
      Ray's daemons) kept busy during the run being predicted: /proc/stat's
      busy time less this service's processes (benchmarks/_cpu_account.py).
      None: no background term (for the probe either).
    - the ``service`` figures: the probe's lone requests ran at ``r`` = cores /
      (engine threads + the probe's background) of their solo speed when that
      is below 1, so the solo overhead is ITL p50 x r less the decode step,
      and the path's latency is TTFT p50 (``probe_prefill``) less the
      (stretched) prefill step.
    """
    from tandem.cluster.planner.profile import Profile

    # tandem profile --shared-cores wrote the cores and the engine's threads
    base = profile.get("host") or {"cores": len(os.sched_getaffinity(0)),
                                   "engine_threads": ENGINE_THREADS}  # fmt: skip
    cores, threads = float(base["cores"]), float(base["engine_threads"])
    cpu = probe["cpu"]
    client_s = probe.get("client_cpu_s", cpu["client"] * cpu["wall_s"])
    idle = probe.get("idle_cpu", {}).get("gateway", 0.0)
    path_cpu_s = max(0.0, cpu["gateway"] - idle) * cpu["wall_s"] + client_s
    per_token = path_cpu_s / max(1, probe["total_output_tokens"])
    others = 0.0 if background_cores is None else cpu["others"]
    rate = min(1.0, cores / (threads + others))
    service = _service(Profile.from_json(profile), profile, probe, rate)
    host = {"cores": cores, "engine_threads": threads, "cpu_per_token_s": per_token,
            "background_cores": background_cores or 0.0}  # fmt: skip
    return {**profile, "service": service, "host": host}


def median_figures(
    profile: dict,
    probes: list[dict],
    figures: Callable[[dict, dict], dict],
) -> dict:
    """``profile`` (JSON) with the sections ``figures(profile, probe)`` adds,
    each number the median over ``probes`` (one per round)."""
    if not probes:
        raise ValueError("median_figures needs at least one probe")
    each = [figures(profile, p) for p in probes]
    out = dict(each[0])
    for section in ("service", "host"):
        if section in each[0]:
            keys = dict.fromkeys(k for f in each for k in f[section])  # a sweep's curves too
            out[section] = {
                k: (median_points if k == "prefill_after_idle_s" else _median_of)(
                    [f[section][k] for f in each if k in f[section]]
                )
                for k in keys
            }
    return out


def _median_of(values: list) -> float | list:
    """The median of numbers, or of curves (``[[count, s], ...]``) count by count."""
    if not any(isinstance(v, list) for v in values):
        return statistics.median(values)
    # probes with and without a sweep: one number is a flat curve, its point at batch 1
    return median_curve([v if isinstance(v, list) else [[1, v]] for v in values])


def probe_spread(probes: list[dict], key: str) -> tuple[float, float, float]:
    """Median, min and max over the probes of ``key``'s p50 (``ttft_ms``, ``itl_ms``)."""
    xs = [p[key]["p50"] for p in probes]
    return statistics.median(xs), min(xs), max(xs)


def median_profile(profiles: list[dict]) -> dict:
    """One profile (JSON) from several measured in the same run (one a round):
    every prefill and decode point the median of the runs' values (each of
    them already the fastest of its repeats), the rest the first one's."""
    if not profiles:
        raise ValueError("median_profile needs at least one profile")
    first = profiles[0]
    for p in profiles[1:]:
        for axis in (("prefill", "batch_tokens"), ("decode", "batch_sizes"),
                     ("decode", "context_tokens")):  # fmt: skip
            if p[axis[0]][axis[1]] != first[axis[0]][axis[1]]:
                raise ValueError(f"profiles differ in {'.'.join(axis)}")
    out = {**first}
    out["prefill"] = {
        **first["prefill"],
        "time_s": [
            statistics.median(xs) for xs in zip(*(p["prefill"]["time_s"] for p in profiles))
        ],
    }
    rows = zip(*(p["decode"]["time_s"] for p in profiles))
    out["decode"] = {
        **first["decode"],
        "time_s": [[statistics.median(xs) for xs in zip(*row)] for row in rows],
    }
    return out


def predict_ways(
    tmp: str,
    profile: str,
    engine_only: dict,
    probes: list[dict] | dict[str, list[dict]],
    reals: dict[str, list[dict]],
    own: bool = False,
) -> dict[str, dict[str, str]]:
    """Per way, per configuration: the profile file to simulate with (docstring).
    ``probes`` a list: the same probes for every configuration (the first
    configuration's); a dict: each configuration's own (``--probe-each``,
    _sim_own.py). With ``own`` the ways are named ``..., own probe`` and the
    engine-only way (no probe) is left out."""
    from benchmarks._sim_own import per_config

    tag, suffix = ("-own", ", own probe") if own else ("", "")

    def write(name: str, obj: dict) -> str:
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            json.dump(obj, f)
        return path

    probes_of = per_config(probes, reals)
    variants = {} if own else {"engine": {n: profile for n in reals}}
    if not all(probes_of.values()):
        return variants
    variants["engine + service" + suffix] = {
        n: write(f"profile-{n}-served{tag}.json",
                 median_figures(engine_only, probes_of[n], service_figures))
        for n in reals
    }  # fmt: skip
    if not all("cpu" in pr for prs in probes_of.values() for pr in prs):
        return variants
    shared_way, no_idle_way = "+ shared cores" + suffix, {}
    variants[shared_way] = {}
    for n in reals:
        shared = median_figures(
            engine_only, probes_of[n], lambda pf, pr: host_figures(pf, pr, None)
        )
        variants[shared_way][n] = write(f"profile-{n}-host{tag}.json", shared)
        if own or n == next(iter(reals)):  # one line when every configuration has the same
            print(f"host figures{suffix} ({n}): " + json.dumps(shared["host"])
                  + ", service " + json.dumps(shared["service"]))  # fmt: skip
        if any("idle" in pr for pr in probes_of[n]):  # without the idle term: session 13's
            plain = [{k: v for k, v in pr.items() if k != "idle"} for pr in probes_of[n]]
            fig = median_figures(engine_only, plain, lambda pf, pr: host_figures(pf, pr, None))
            no_idle_way[n] = write(f"profile-{n}-host-no-idle{tag}.json", fig)
    bg_way = "+ shared cores + background" + suffix
    variants[bg_way] = {}
    for n, runs in reals.items():
        bg = statistics.median(r["cpu"]["others"] for r in runs)
        fig = median_figures(
            engine_only, probes_of[n], lambda pf, pr, bg=bg: host_figures(pf, pr, bg)
        )
        variants[bg_way][n] = write(f"profile-{n}-bg{tag}.json", fig)
    if len(no_idle_way) == len(reals):
        variants["+ shared cores, no idle term" + suffix] = no_idle_way
    return variants
