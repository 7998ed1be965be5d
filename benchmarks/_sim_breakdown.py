"""benchmarks/simulator.py's breakdown of a time to first token: where a
served request's first token spent its time, beside where the simulator's
did (issue 28: the measured TTFT ran 1-6 ms above the prediction).

A served request, from the timestamps the system already takes (every one a
``time.perf_counter``, i.e. CLOCK_MONOTONIC, one clock for every process on
the box; the engine's are offsets from its receipt of the request):

    client send ─http_in─ gateway arrival ─gateway─ dispatch ─hops(1/2)─ P receipt
      ─p_queue─ P step start ─p_step─ P first token ─p_out─ P final output
      ─hops(2/2)─ gateway has it ─sse_out─ client reads the first chunk

- ``http_in``: the client's POST until the gateway's route runs (aiohttp, the
  socket, uvicorn's parse); the client's send time and the gateway's
  ``RequestRecord.arrival_s``.
- ``gateway``: arrival to dispatch (body decode, validation, the request's
  record; ``RequestRecord.dispatch_s``).
- ``hops``: dispatch to the gateway's receipt of P's output less P's own time
  (``RequestTimings.finished_s``): the ZMQ send to P and P's output back,
  routing, P's loop reading its input and sending its output, the gateway's
  reader task and the request's queue. The engine's offsets are anchored at
  the gateway's receipt (cluster/observability/tracing/record.py), so the two
  directions are one figure.
- ``p_queue``: P's receipt to the start of the step that first computes the
  prompt (``scheduled_s``): a step already running, and the loop's wait.
- ``p_step``: that step's start to P's first token (``first_token_s``):
  ``schedule()``, the forward, ``update_from_output`` (for a chunked prompt,
  every chunk's step).
- ``p_out``: first token to P's final output (0 for a one-token request).
- ``sse_out``: the gateway's receipt of the first token until the client's
  read of the chunk (detokenize, the SSE event, the socket, aiohttp).

The simulator's request (``cluster/planner/metrics.ttft_parts``): ``path``
(the profile's ``request_latency_s``), ``queue`` and ``step`` (the profile's
prefill step, its ``step_overhead_s``, stretched by contention). ``path`` is
what ``http_in + gateway + hops + p_out + sse_out`` measure; ``queue`` is
``p_queue``; ``step`` is ``p_step``. ``profile_step`` is the profile's
``prefill_s`` of each request's prompt: ``p_step`` less it is what the served
prefill step costs beyond the profiled one.
"""

from __future__ import annotations

import statistics
from typing import Any

MEASURED = ("http_in", "gateway", "hops", "p_queue", "p_step", "p_out", "sse_out", "ttft")
# the simulator's parts and the measured parts each one stands for
SIM_PARTS = {
    "path": ("http_in", "gateway", "hops", "p_out", "sse_out"),
    "queue": ("p_queue",),
    "step": ("p_step",),
    "ttft": ("ttft",),
}


class RecordCollector:
    """A gateway tracer (``ServiceThread(tracer=...)``) that keeps each
    finished request's timestamps, for ``take()``."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Any]] = {}

    def export(self, record: Any) -> None:
        leg = record.prefill_leg
        if leg is None or record.first_token_s < 0 or record.dispatch_s < 0:
            return
        t = leg.timings
        self._rows[record.request_id] = {
            "path": record.path,
            "arrival_s": record.arrival_s,
            "dispatch_s": record.dispatch_s,
            "first_token_s": record.first_token_s,
            "end_s": record.end_s,  # the last output: the stream decodes until then
            "prompt_tokens": record.num_prompt_tokens,
            "scheduled_s": t.scheduled_s,
            "p_first_token_s": t.first_token_s,
            "finished_s": t.finished_s,
            "p_engine": t.engine_id,  # whose idle time a step follows (_sim_idle.py)
        }
        d = record.decode_leg
        if d is not None:  # D's first step after the handoff (_sim_idle.py)
            dt = d.timings
            self._rows[record.request_id].update(
                d_received_s=d.received_s,
                d_finished_s=dt.finished_s,
                d_kv_load_end_s=dt.kv_load_end_s,
                d_first_token_s=dt.first_token_s,
                d_engine=dt.engine_id,  # which decode engine (--probe-each: the routing)
            )

    def take(self) -> dict[str, dict[str, Any]]:
        """The requests finished since the last call, by request id."""
        rows, self._rows = self._rows, {}
        return rows

    def shutdown(self) -> None:
        pass


def request_parts(stamp: list, row: dict[str, Any]) -> dict[str, float] | None:
    """One request's parts in ms: ``stamp`` the client's ``[request_id,
    send time, ttft_s]`` (perf_counter), ``row`` the collector's."""
    _, sent_s, ttft_s = stamp
    if row["path"] != "remote" or row["scheduled_s"] < 0 or row["p_first_token_s"] < 0:
        return None
    gw_first_s = row["first_token_s"]
    parts_s = {
        "http_in": row["arrival_s"] - sent_s,
        "gateway": row["dispatch_s"] - row["arrival_s"],
        "hops": gw_first_s - row["dispatch_s"] - row["finished_s"],
        "p_queue": row["scheduled_s"],
        "p_step": row["p_first_token_s"] - row["scheduled_s"],
        "p_out": row["finished_s"] - row["p_first_token_s"],
        "sse_out": sent_s + ttft_s - gw_first_s,
        "ttft": ttft_s,
    }
    return {k: v * 1000.0 for k, v in parts_s.items()}


def run_parts(
    stamps: list[list], rows: dict[str, dict[str, Any]], profile: Any = None
) -> dict[str, float]:
    """Medians over a run's requests of each part (ms), with ``profile_step``
    (the ``Profile``'s prefill of each prompt) when a profile is given, and
    ``n`` the requests joined."""
    each = []
    for stamp in stamps:
        row = rows.get(stamp[0])
        parts = request_parts(stamp, row) if row is not None else None
        if parts is None:
            continue
        if profile is not None:
            parts["profile_step"] = profile.prefill_s(row["prompt_tokens"]) * 1000.0
        each.append(parts)
    if not each:
        return {"n": 0}
    out = {k: statistics.median(p[k] for p in each) for k in each[0]}
    out["n"] = len(each)
    return out


def median_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    """One configuration's rounds: each part the median of the rounds' medians."""
    runs = [r for r in runs if r.get("n")]
    if not runs:
        return {}
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "n"}


def breakdown_table(rows: list[tuple[str, dict[str, float], dict[str, float]]]) -> str:
    """Per configuration: the measured parts (median of the rounds) and the
    simulator's, side by side; each simulated part against the sum of the
    measured parts it stands for."""
    lines = [
        "| config | " + " | ".join(MEASURED) + " | profile_step "
        "| sim path | sim queue | sim step | sim ttft |",
        "|---|" + "---:|" * (len(MEASURED) + 5),
    ]
    for name, measured, sim in rows:
        if not measured:
            continue
        cells = [f"{measured.get(k, float('nan')):.2f}" for k in MEASURED]
        cells.append(f"{measured.get('profile_step', float('nan')):.2f}")
        for part, keys in SIM_PARTS.items():
            real = sum(measured.get(k, 0.0) for k in keys)
            got = sim.get(part)
            cells.append("-" if got is None else f"{got:.2f} ({got - real:+.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_breakdown(
    engine_only: dict, reals: dict, probes: list[dict], sims: dict, names: list, ways: list
) -> None:
    """The TTFT's parts, measured (median over the rounds of each run's
    medians) beside the simulator's (the most complete way), and the probes'."""
    from tandem.cluster.planner.profile import Profile

    prof = Profile.from_json(engine_only)
    way = ways[min(2, len(ways) - 1)]  # + shared cores when the probes gave it
    rows = []
    for n in names:
        runs = [run_parts(r["stamps"], r["rows"], prof) for r in reals[n] if "rows" in r]
        rows.append((n, median_parts(runs), sims[way, n].get("ttft_parts_ms", {})))
    for label, key in (("lone", None), ("cached", "cached")):
        runs = []
        for pr in probes:
            run = pr if key is None else pr.get(key) or {}
            if "rows" in run:
                runs.append(run_parts(run["stamps"], run["rows"], prof))
        if runs:
            rows.append((f"probe, {label}", median_parts(runs), {}))
    if any(m for _, m, _ in rows):
        print(f"\nTTFT parts, ms (medians; docs in benchmarks/_sim_breakdown.py; sim: {way}):")
        print(breakdown_table(rows))
