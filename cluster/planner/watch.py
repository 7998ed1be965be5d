"""Between the sla planner's rounds: a measured SLO breach re-plans at once.

The sla planner's round (``SlaPlanner.decide``, every ``--planner-interval-s``)
predicts the next interval from the last one, so a change in the mix is seen
up to an interval late, and the engines it then asks for serve a cold start
after that. The watch (``SlaPlanner.watch``, every
``--planner-watch-interval-s``) looks at the same ``Observation`` in between
and acts only on a breach it can measure, not on a prediction:

    prefill  the prompts queued on the ready prefill engines, per engine,
             plus one more prompt, take ``prefill_s((queued + 1) x prompt)``
             at the profile's speed: the time the next arrival waits for its
             first token. Over ``--ttft-slo-ms``: ``ttft_breach``.
    decode   the median latest step time of the warm decode engines that are
             running requests (every running request waits that step for its
             next token). Over ``--itl-slo-ms``: ``itl_breach``.

``prompt`` is the mean prompt of the requests that arrived since the last
round (the queue is made of them), else the round's prediction. On a breach
the planner re-plans both pools with the window's load (``window_load``):
the arrival rate since the last round, plus the queued requests drained over
one interval (they must be served on top of what keeps arriving), and that
window's mean prompt and asked-for output. Hysteresis and cooldowns are the
round's own, and a pool that breaches never shrinks in a watch (arrivals
that stopped while its queue drains are the next round's to judge).
Nothing here predicts, so noise cannot trigger it: in the benchmark's
decode-heavy phase a burst would need some 100 short prompts queued on one
engine to breach a 2 s TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.cluster.planner.sla import Load


@dataclass(frozen=True)
class Breach:
    pool: str  # prefill | decode
    reason: str  # ttft_breach | itl_breach
    inputs: dict[str, float]  # what was measured, for the decision's log


@dataclass(frozen=True)
class Window:
    """The traffic since the last round."""

    seconds: float
    arrivals: int
    rate: float  # arrivals per second
    prompt_tokens: float  # mean of the window's arrivals (the prediction's when none)
    output_tokens: float  # the window's mean max_tokens, capped by the prediction


def window(last: Any, obs: Any, predicted: Load) -> Window | None:
    """``last``/``obs``: the last round's and this ``Observation``;
    ``predicted``: the last round's load. None when no time passed."""
    dt = obs.time_s - last.time_s
    if dt <= 0:
        return None
    n = max(0, obs.arrivals - last.arrivals)
    prompt = (obs.prompt_tokens - last.prompt_tokens) / n if n else predicted.prompt_tokens
    output = predicted.output_tokens
    asked = obs.requested_output_tokens - last.requested_output_tokens
    if n and asked > 0:
        output = max(1.0, min(output, asked / n))
    return Window(dt, n, n / dt, max(1.0, prompt), output)


def prefill_breach(obs: Any, win: Window, profile: Any, ttft_slo_ms: float) -> Breach | None:
    ready = [e for e in obs.pools.get("prefill", []) if e.ready]
    if not ready:
        return None
    queued = sum(e.waiting for e in ready) / len(ready)
    if queued <= 0:
        return None
    next_ttft_s = profile.prefill_s(max(1, round((queued + 1) * win.prompt_tokens)))
    if next_ttft_s * 1000.0 <= ttft_slo_ms:
        return None
    inputs = {"queued_per_engine": queued, "measured_ttft_ms": next_ttft_s * 1000.0}
    return Breach("prefill", "ttft_breach", inputs)


def decode_breach(obs: Any, warmup_steps: int, itl_slo_ms: float) -> Breach | None:
    steps = sorted(
        e.last_step_s
        for e in obs.pools.get("decode", [])
        if e.ready and e.running and e.num_steps >= warmup_steps and e.last_step_s > 0
    )
    if not steps:
        return None
    median = steps[len(steps) // 2]
    if median * 1000.0 <= itl_slo_ms:
        return None
    return Breach("decode", "itl_breach", {"measured_itl_ms": median * 1000.0})


def breaches(obs: Any, win: Window, profile: Any, config: Any) -> list[Breach]:
    found = [
        prefill_breach(obs, win, profile, config.ttft_slo_ms),
        decode_breach(obs, config.planner_warmup_steps, config.itl_slo_ms),
    ]
    return [b for b in found if b is not None]


def window_load(obs: Any, win: Window, interval_s: float) -> Load:
    """The load to re-plan for: the window's arrivals plus the prefill queue
    drained over one interval."""
    queued = sum(e.waiting for e in obs.pools.get("prefill", []) if e.ready)
    return Load(win.rate + queued / interval_s, win.prompt_tokens, win.output_tokens)
