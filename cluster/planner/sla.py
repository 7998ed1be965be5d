"""The SLA planner's arithmetic: engine counts from a predicted load.

A pure function of numbers (no Ray, no clock), so every count can be checked
by hand. The model, per pool:

Prefill. Each of ``N`` engines receives ``rate / N`` requests/s; a prompt of
``P`` tokens alone takes ``prefill_s(P)``. Prompts that queue are batched into
steps of up to ``B = max_num_batched_tokens`` (the profile's scheduler), so a
prompt costs the engine ``s = min(prefill_s(P), P * prefill_s(B) / B)``: its own
step, or its share of a full one. On a CPU a step costs about its tokens and
the two agree; on a GPU a short prompt's own step is mostly fixed cost (the 1B
shape on an H200: 12 ms for 128 or 2048 tokens, 51 ms for 8192), and counting
it whole would take 4x the prefill engines a batching engine needs. The queue
is treated as M/M/1 with mean service time ``s`` (conservative next to
deterministic service): utilization ``rho = rate * s / N``, and the waiting
time exceeds ``t`` with probability ``rho * exp(-(1 - rho) * t / s)``, so its
p90 is ``0`` when ``rho <= 0.1`` and ``s * ln(10 * rho) / (1 - rho)`` otherwise.
TTFT p90 = wait p90 + ``prefill_s(P)``: the prefill engine samples the first token and the
gateway streams it at once (``cluster/disagg/orchestration.py``; the simulator
does the same), so the handoff and the decode engine's first step are not on
the path to the first token.

Decode. Each of ``N`` engines holds ``c`` requests at once (Little's law:
``c = rate / N * O * itl``), each attending to ``P + O / 2`` tokens on
average, and one step of the batch takes ``itl = decode_s(c, c * (P + O/2))``.
``c`` is the fixed point of those two, found by iteration from ``c = 1``;
no fixed point under ``max_num_seqs`` means the pool is overloaded. Every
request in a step waits the same step, so ITL p90 is ``itl``.

A count meets the SLO when its p90 is within it. ``required`` is the fewest
engines in ``[min, max]`` that do (``max`` if none does, with
``feasible=False``). ``decide`` adds hysteresis for a planner that already
runs ``current`` engines: it scales out at once to the required count, but
scales in only to the fewest engines that would still meet the SLO at
``(1 + scale_in_margin) x`` the predicted rate, so a rate wavering at the
edge between ``N - 1`` and ``N`` keeps ``N``: removing an engine must leave
each survivor, now loaded ``N / (N - 1)`` times as much, under its SLO with
room to spare. No traffic (rate 0, or no observation) gives the minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.cluster.planner.profile import Profile


@dataclass(frozen=True)
class Load:
    rate: float  # requests/s predicted for the next interval (0: none observed)
    prompt_tokens: float  # mean
    output_tokens: float  # mean


@dataclass(frozen=True)
class PoolPlan:
    engines: int
    p90_ms: float  # the predicted TTFT p90 (prefill) or ITL p90 (decode) at that count
    feasible: bool
    reason: str


def prefill_share_s(profile: Profile, p: int) -> float:
    """An engine's time per prompt of ``p`` tokens when prompts are batched into steps
    of up to the profile's ``max_num_batched_tokens`` (module doc)."""
    alone = profile.prefill_s(p)
    budget = int(profile.scheduler.get("max_num_batched_tokens", 0) or 0)
    if budget <= p:
        return alone
    return min(alone, p * profile.prefill_s(budget) / budget)


def prefill_ttft_p90_s(load: Load, profile: Profile, engines: int) -> float:
    p = max(1, round(load.prompt_tokens))
    s = prefill_share_s(profile, p)
    rho = load.rate * s / engines
    if rho >= 1.0:
        return math.inf
    wait = 0.0 if rho <= 0.1 else s * math.log(10.0 * rho) / (1.0 - rho)
    return wait + profile.prefill_s(p)


def decode_itl_p90_s(load: Load, profile: Profile, engines: int, max_num_seqs: int = 256) -> float:
    ctx = load.prompt_tokens + load.output_tokens / 2.0
    per_engine = load.rate / engines * load.output_tokens  # tokens/s each engine must emit
    c = 1.0
    for _ in range(200):
        itl = profile.decode_s(max(1.0, c), max(1.0, c) * ctx)
        nxt = per_engine * itl
        if nxt > max_num_seqs:
            return math.inf
        if abs(nxt - c) < 1e-9:
            break
        c = nxt
    else:
        return math.inf  # no fixed point: the batch keeps growing
    return profile.decode_s(max(1.0, c), max(1.0, c) * ctx)


def _fewest(p90, slo_s: float, lo: int, hi: int, what: str) -> PoolPlan:
    for n in range(lo, hi + 1):
        v = p90(n)
        if v <= slo_s:
            return PoolPlan(n, v * 1000.0, True, f"{what} p90 {v * 1000:.1f} ms <= SLO at {n}")
    v = p90(hi)
    return PoolPlan(hi, v * 1000.0, False, f"{what} p90 over SLO even at max ({hi})")


def required(
    load: Load,
    profile: Profile,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    min_engines: tuple[int, int] = (1, 1),
    max_engines: tuple[int, int] = (64, 64),
    max_num_seqs: int | None = None,
) -> tuple[PoolPlan, PoolPlan]:
    """The fewest (prefill, decode) engines whose predicted p90s meet the SLOs."""
    if ttft_slo_ms <= 0:
        raise ValueError(f"--ttft-slo-ms must be > 0, got {ttft_slo_ms}")
    if itl_slo_ms <= 0:
        raise ValueError(f"--itl-slo-ms must be > 0, got {itl_slo_ms}")
    for name, lo, hi in zip(("prefill", "decode"), min_engines, max_engines):
        if not 1 <= lo <= hi:
            raise ValueError(f"--min-engines/--max-engines for {name}: need 1 <= min <= max")
    if load.rate < 0:
        raise ValueError(f"rate must be >= 0, got {load.rate}")
    if load.rate == 0:
        reason = "no traffic: minimum"
        return PoolPlan(min_engines[0], 0.0, True, reason), PoolPlan(
            min_engines[1], 0.0, True, reason
        )
    seqs = max_num_seqs or int(profile.scheduler.get("max_num_seqs", 256))
    pre = _fewest(
        lambda n: prefill_ttft_p90_s(load, profile, n),
        ttft_slo_ms / 1000.0,
        min_engines[0],
        max_engines[0],
        "TTFT",
    )
    dec = _fewest(
        lambda n: decode_itl_p90_s(load, profile, n, seqs),
        itl_slo_ms / 1000.0,
        min_engines[1],
        max_engines[1],
        "ITL",
    )
    return pre, dec


def decide(
    load: Load,
    profile: Profile,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    current: tuple[int, int],
    min_engines: tuple[int, int] = (1, 1),
    max_engines: tuple[int, int] = (64, 64),
    scale_in_margin: float = 0.1,
) -> tuple[int, int]:
    """The planner's next (prefill, decode) counts from ``current``, with
    hysteresis on the way in (module doc)."""
    if scale_in_margin < 0:
        raise ValueError(f"scale_in_margin must be >= 0, got {scale_in_margin}")
    need = required(load, profile, ttft_slo_ms, itl_slo_ms, min_engines, max_engines)
    padded = Load(load.rate * (1.0 + scale_in_margin), load.prompt_tokens, load.output_tokens)
    safe = required(padded, profile, ttft_slo_ms, itl_slo_ms, min_engines, max_engines)
    out = []
    for cur, n, s in zip(current, need, safe):
        if n.engines >= cur:
            out.append(n.engines)  # scale out (or stay) at once
        else:
            out.append(min(cur, max(n.engines, s.engines)))
    return out[0], out[1]
