"""The running planner's decisions, from what the gateway observed.

Pure logic on numbers and a clock value passed in (``Observation.time_s``),
so every decision can be replayed in a test against a fake clock. The runner
(``runner.py``) builds an ``Observation`` every ``--planner-interval-s`` and
hands the decisions to the same resize the admin route calls.

``load`` (``LoadPlanner``), per pool, from the ready engines' figures:

    queue = requests waiting per ready engine, kv = mean KV cache usage
    scale out by one   queue > --planner-queue-high or kv > --planner-kv-high,
                       once --planner-scale-out-cooldown-s passed since the pool changed
    scale in by one    queue <= --planner-queue-low and kv < --planner-kv-low, and the
                       survivors would stay under the high marks (each gets N/(N-1) of
                       the load), once --planner-scale-in-cooldown-s passed
    hold               otherwise (the band between low and high is the hysteresis)

A pool with no figures (no traffic, no stats yet) counts as idle: it goes
down to its minimum instead of freezing at its size.

``sla`` (``SlaPlanner``): the interval's arrival rate and mean prompt length
(arrivals), mean output length (requests that ended, capped by the
arrivals' mean ``max_tokens``, which sees a shift to shorter answers at
once) predict the next
interval (``Predictor``: the larger of the last interval and a decaying
average, so a ramp is met at once and a lull is believed slowly); ``sla.decide``
turns them into (prefill, decode) counts with the profile as the engine's
speed, and its scale-in margin keeps a load at the N-1/N edge from
oscillating. The profile's decode times are corrected by the engines'
observed step times (``SpeedCorrection``): an engine's last step against the
profile's time for its batch and context; an engine's first
``--planner-warmup-steps`` steps (a cold start: allocation, first kernels,
graph capture) are not its speed and never count. Prefill times are
corrected the same way (``prefill_speed``): a prefill engine's latest step
against the profile's time for the tokens it computed. Between rounds,
``SlaPlanner.watch`` re-plans at once on a measured TTFT or ITL breach
(watch.py); without one it decides nothing. Where the deployment can move
an engine between pools (``moves=True``: moves.py), a pool that grows takes
the other pool's surplus by the same model before any new engine starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.planner import moves as pool_moves
from tandem.cluster.planner import sla, watch
from tandem.cluster.planner.config import PlannerConfig
from tandem.cluster.planner.moves import HOLD, MOVE_IN, MOVE_OUT, SCALE_IN, SCALE_OUT

__all__ = ["HOLD", "MOVE_IN", "MOVE_OUT", "SCALE_IN", "SCALE_OUT"]


@dataclass(frozen=True)
class EngineSample:
    engine_id: str
    ready: bool
    epoch: int = 0
    running: int = 0
    waiting: int = 0  # waiting to be scheduled, or for KV from a prefill engine
    kv_usage: float = 0.0  # 0..1
    num_steps: int = 0  # cumulative, since the engine's start (its epoch)
    last_step_s: float = 0.0  # its latest step's duration
    last_step_tokens: int = 0  # the tokens that step computed
    context_tokens: float = 0.0  # tokens its running batch attends to (about)


@dataclass(frozen=True)
class Observation:
    time_s: float  # the runner's clock (monotonic, or a test's)
    pools: dict[str, list[EngineSample]]  # role -> its engines, ready or not
    # cumulative, the gateway's own: requests arrived and their prompt tokens;
    # requests ended and their output tokens
    arrivals: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    output_tokens: int = 0
    requested_output_tokens: int = 0  # cumulative max_tokens of the arrivals


@dataclass(frozen=True)
class Decision:
    pool: str
    action: str  # scale_out | scale_in | hold | move_in | move_out (moves.py)
    reason: str
    current: int
    target: int
    inputs: dict[str, float] = field(default_factory=dict)
    moved: int = 0  # move_in / move_out: engines of the change that change pool
    source: str = ""  # move_in / move_out: the pool the moved engines leave


Bounds = dict[str, tuple[int, int]]  # role -> (min engines, max engines)


class Cooldowns:
    """When each pool last changed size (the planner's own actions and any other)."""

    def __init__(self) -> None:
        self._changed: dict[str, tuple[float, int]] = {}  # role -> (time, size)

    def since_change(self, role: str, now: float, size: int) -> float:
        last = self._changed.get(role)
        if last is None or last[1] != size:  # first sight, or resized by someone else
            self._changed[role] = (now, size) if last is not None else (-math.inf, size)
            last = self._changed[role]
        return now - last[0]

    def changed(self, role: str, now: float, size: int) -> None:
        self._changed[role] = (now, size)


class LoadPlanner:
    def __init__(self, config: PlannerConfig, bounds: Bounds) -> None:
        self.config = config
        self.bounds = bounds
        self.cooldowns = Cooldowns()

    def decide(self, obs: Observation) -> list[Decision]:
        return [self._pool(role, engines, obs.time_s) for role, engines in obs.pools.items()]

    def _pool(self, role: str, engines: list[EngineSample], now: float) -> Decision:
        c = self.config
        lo, hi = self.bounds[role]
        n = len(engines)
        ready = [e for e in engines if e.ready]
        queue = sum(e.waiting for e in ready) / len(ready) if ready else 0.0
        kv = sum(e.kv_usage for e in ready) / len(ready) if ready else 0.0
        idle = not any(e.running or e.waiting for e in ready)
        inputs = {"queue_per_engine": queue, "kv_usage": kv, "ready": float(len(ready))}
        since = self.cooldowns.since_change(role, now, n)
        inputs["since_change_s"] = min(since, 1e9)

        def out(action: str, reason: str, target: int) -> Decision:
            if target != n:
                self.cooldowns.changed(role, now, target)
            return Decision(role, action, reason, n, target, inputs)

        if n < lo:
            return out(SCALE_OUT, "below_min", lo)
        if n > hi:
            return out(SCALE_IN, "above_max", hi)
        hot = "queue_high" if queue > c.planner_queue_high else None
        hot = hot or ("kv_high" if kv > c.planner_kv_high else None)
        if hot is not None:
            if n >= hi:
                return out(HOLD, "at_max", n)
            if since < c.planner_scale_out_cooldown_s:
                return out(HOLD, "cooldown", n)
            return out(SCALE_OUT, hot, n + 1)
        if queue <= c.planner_queue_low and kv < c.planner_kv_low and n > lo:
            share = n / (n - 1)  # each survivor's load after one goes
            if queue * share > c.planner_queue_high or kv * share > c.planner_kv_high:
                return out(HOLD, "survivors_would_overload", n)
            if since < c.planner_scale_in_cooldown_s:
                return out(HOLD, "cooldown", n)
            return out(SCALE_IN, "no_traffic" if idle else "underused", n - 1)
        return out(HOLD, "at_min" if n <= lo else "within_band", n)


class Predictor:
    """Next interval's load from the last ones: the larger of the last
    interval and a decaying average (module doc)."""

    def __init__(self, decay: float = 0.5, default_output_tokens: float = 128.0) -> None:
        self.decay = decay
        self.rate_avg = 0.0
        self.prompt_tokens = 0.0
        self.output_tokens = default_output_tokens
        self._last: Observation | None = None
        self.load = sla.Load(0.0, 0.0, default_output_tokens)  # the latest prediction

    @property
    def last(self) -> Observation | None:
        """The observation of the latest round (None before the first)."""
        return self._last

    def observe(self, obs: Observation) -> sla.Load | None:
        """The predicted load; None at the first observation (no interval yet)."""
        last, self._last = self._last, obs
        if last is None:
            return None
        if obs.time_s <= last.time_s:
            self.load = sla.Load(self.rate_avg, self.prompt_tokens, self.output_tokens)
            return self.load
        dt = obs.time_s - last.time_s
        arrivals = max(0, obs.arrivals - last.arrivals)
        finished = max(0, obs.finished - last.finished)
        rate = arrivals / dt
        if arrivals:
            self.prompt_tokens = (obs.prompt_tokens - last.prompt_tokens) / arrivals
        if finished:
            self.output_tokens = max(1.0, (obs.output_tokens - last.output_tokens) / finished)
        asked = obs.requested_output_tokens - last.requested_output_tokens
        if arrivals and asked > 0:
            # what the new requests may produce at most: the ended ones' mean
            # lags a shift to shorter answers by a whole answer's time
            self.output_tokens = max(1.0, min(self.output_tokens, asked / arrivals))
        self.rate_avg = self.decay * self.rate_avg + (1.0 - self.decay) * rate
        if self.rate_avg < 1e-3 and not rate:
            self.rate_avg = 0.0  # a lull long enough is no traffic
        self.load = sla.Load(max(rate, self.rate_avg), self.prompt_tokens, self.output_tokens)
        return self.load


class SpeedCorrection:
    """Observed step time over the profile's, from warm engines only: by
    default a decode engine's latest step against ``decode_s`` of its batch
    and context; ``expected`` gives another pool's (0: the step says nothing)."""

    def __init__(
        self,
        profile: Any,
        warmup_steps: int,
        smoothing: float = 0.5,
        expected: Callable[[EngineSample], float] | None = None,
    ) -> None:
        self.profile = profile
        self.warmup_steps = warmup_steps
        self.smoothing = smoothing
        self.expected = expected or self._decode_expected
        self.factor = 1.0
        self._prev: dict[str, EngineSample] = {}

    def _decode_expected(self, e: EngineSample) -> float:
        if not e.running:
            return 0.0
        return self.profile.decode_s(e.running, max(1.0, e.context_tokens))

    def observe(self, engines: list[EngineSample]) -> float:
        ratios = []
        seen = {}
        for e in engines:
            seen[e.engine_id] = e
            prev = self._prev.get(e.engine_id)
            warm = (
                prev is not None
                and prev.epoch == e.epoch  # a restart is a new cold start
                and prev.num_steps >= self.warmup_steps
                and e.num_steps > prev.num_steps  # it stepped in this interval
            )
            if warm and e.last_step_s > 0:
                expected = self.expected(e)
                if expected > 0:
                    ratios.append(e.last_step_s / expected)
        self._prev = seen
        if ratios:
            ratios.sort()
            median = ratios[len(ratios) // 2]
            blended = self.smoothing * self.factor + (1.0 - self.smoothing) * median
            self.factor = min(8.0, max(0.25, blended))
        return self.factor


def prefill_speed(profile: Any, warmup_steps: int) -> SpeedCorrection:
    """A prefill engine's latest step against ``prefill_s`` of the tokens it
    computed (steps that computed none say nothing)."""

    def expected(e: EngineSample) -> float:
        return profile.prefill_s(e.last_step_tokens) if e.last_step_tokens > 0 else 0.0

    return SpeedCorrection(profile, warmup_steps, expected=expected)


class ScaledProfile:
    """A profile whose decode (and prefill) step times are multiplied by a factor."""

    def __init__(self, profile: Any, decode_factor: float, prefill_factor: float = 1.0) -> None:
        self._p = profile
        self.decode_factor = decode_factor
        self.prefill_factor = prefill_factor
        self.scheduler = profile.scheduler

    def prefill_s(self, batch_tokens: int) -> float:
        return self._p.prefill_s(batch_tokens) * self.prefill_factor

    def decode_s(self, batch_size: float, context_tokens: float) -> float:
        return self._p.decode_s(batch_size, context_tokens) * self.decode_factor

    def handoff_s(self, num_tokens: int) -> float:
        return self._p.handoff_s(num_tokens)


class SlaPlanner:
    POOLS = ("prefill", "decode")

    def __init__(
        self, config: PlannerConfig, bounds: Bounds, profile: Any, moves: bool = False
    ) -> None:
        missing = [r for r in self.POOLS if r not in bounds]
        if missing or set(bounds) - set(self.POOLS):
            raise ValueError(
                "planner: sla plans a prefill and a decode pool; use --planner load for "
                "a colocated pool"
            )
        self.config = config
        self.bounds = bounds
        self.profile = profile
        self.predictor = Predictor()
        self.speed = SpeedCorrection(profile, config.planner_warmup_steps)
        self.prefill_speed = prefill_speed(profile, config.planner_warmup_steps)
        self.cooldowns = Cooldowns()
        self.moves = moves  # the deployment can move an engine between pools (moves.py)

    def decide(self, obs: Observation) -> list[Decision]:
        """A round: the next interval's load predicted from the last one."""
        load = self.predictor.observe(obs)
        self.speed.observe(obs.pools.get("decode", []))
        self.prefill_speed.observe(obs.pools.get("prefill", []))
        if load is None:  # the first look: a baseline for the next interval's rates
            return [
                Decision(r, HOLD, "baseline", n, n) for r, n in zip(self.POOLS, self._sizes(obs))
            ]
        return self._plan(obs, load, [])

    def watch(self, obs: Observation) -> list[Decision]:
        """Between rounds (watch.py): a re-plan on the traffic since the last
        round when a breach is measured; [] when none is, or when the re-plan
        changes nothing (engines already starting)."""
        last = self.predictor.last
        if last is None:
            return []
        win = watch.window(last, obs, self.predictor.load)
        if win is None:
            return []
        found = watch.breaches(obs, win, self._corrected(), self.config)
        if not found:
            return []
        load = watch.window_load(obs, win, self.config.planner_interval_s)
        decisions = self._plan(obs, load, found, win.seconds)
        return decisions if any(d.action != HOLD for d in decisions) else []

    def _corrected(self) -> ScaledProfile:
        """The profile at the engines' observed speed."""
        return ScaledProfile(self.profile, self.speed.factor, self.prefill_speed.factor)

    def _sizes(self, obs: Observation) -> tuple[int, ...]:
        return tuple(len(obs.pools.get(r, [])) for r in self.POOLS)

    def _plan(
        self,
        obs: Observation,
        load: sla.Load,
        found: list[watch.Breach],
        window_s: float = 0.0,
    ) -> list[Decision]:
        c = self.config
        current = self._sizes(obs)
        lo = tuple(self.bounds[r][0] for r in self.POOLS)
        hi = tuple(self.bounds[r][1] for r in self.POOLS)
        clamped = tuple(min(h, max(lo_, n)) for n, lo_, h in zip(current, lo, hi))
        profile = self._corrected()
        target = sla.decide(load, profile, c.ttft_slo_ms, c.itl_slo_ms, clamped, lo, hi)
        need = sla.required(load, profile, c.ttft_slo_ms, c.itl_slo_ms, lo, hi)
        inputs = {
            "rate_per_s": load.rate,
            "prompt_tokens": load.prompt_tokens,
            "output_tokens": load.output_tokens,
            "decode_speed_factor": profile.decode_factor,
            "prefill_speed_factor": profile.prefill_factor,
        }
        if found:  # a watch's re-plan: its window and every breach measured
            inputs["window_s"] = window_s
            for b in found:
                inputs.update(b.inputs)
        breached = {b.pool: b.reason for b in found}
        out = []
        for role, n, want, plan, least in zip(self.POOLS, current, target, need, lo):
            since = self.cooldowns.since_change(role, obs.time_s, n)
            row = {**inputs, "predicted_p90_ms": plan.p90_ms, "since_change_s": min(since, 1e9)}
            slo = "ttft_slo" if role == "prefill" else "itl_slo"
            if role in breached and want < n:
                want = n  # a pool missing its SLO now never shrinks, whatever the window says
            if n < least:
                action, reason = SCALE_OUT, "below_min"
            elif want > n:
                if since < c.planner_scale_out_cooldown_s:
                    action, reason, want = HOLD, "cooldown", n
                else:
                    action, reason = SCALE_OUT, breached.get(role, slo)
            elif want < n:
                if since < c.planner_scale_in_cooldown_s:
                    action, reason, want = HOLD, "cooldown", n
                else:
                    action = SCALE_IN
                    reason = "no_traffic" if load.rate == 0 else f"{slo}_met_with_fewer"
            else:
                action = HOLD
                reason = f"{slo}_met" if plan.feasible else f"{slo}_missed_at_max"
                reason = breached.get(role, reason)
            if want != n:
                self.cooldowns.changed(role, obs.time_s, want)
            out.append(Decision(role, action, reason, n, want, row))
        return pool_moves.pair(out) if self.moves else out


def make_planner(
    config: PlannerConfig, bounds: Bounds, profile: Any = None, moves: bool = False
) -> Any:
    """The planner ``config.planner`` names (None when off); ``moves``: the
    deployment can move an engine between pools (moves.py), sla only."""
    if config.planner == "load":
        return LoadPlanner(config, bounds)
    if config.planner == "sla":
        return SlaPlanner(config, bounds, profile, moves)
    return None
