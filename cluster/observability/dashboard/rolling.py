"""Rolling request statistics for ``/cluster/state``, read off the gateway's
own cumulative metrics: nothing is added to the per-token path.

A timer on the event loop copies the cumulative TTFT and ITL histograms (both paths
merged) and the token / request counters of ``GatewayMetrics`` every
``interval_s`` into a ring covering ``window_s``. The difference of two
samples is what happened between them: a histogram of the interval (its
p50 / p99 interpolated inside buckets, as Prometheus' ``histogram_quantile``
does) and tokens per second. Counters are counted when a request ends, so a
point's tokens/s is that of the requests that finished in its interval.

Several gateways (``peers``, ``gateway_peers.GatewayPeers``): each publishes
its own cumulative values with its other figures (``cumulative``, about once
a second) and every gateway's sample is its own plus the others' last
published ones, so the window and series are the cluster's, the same on
every gateway (the others' part at most about a second old). A gateway gone
stale keeps its last values (they add nothing to later intervals); one that
restarted continues from its predecessor's last published values (what the
predecessor did after that is lost, and differences are clamped at zero).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from tandem.cluster.observability.metrics import GatewayMetrics, PathHistogram
from tandem.scheduler.engine_stats import HistogramSnapshot, quantile

logger = logging.getLogger(__name__)


class _Sample(msgspec.Struct):
    mono_s: float
    wall_s: float
    ttft: HistogramSnapshot
    itl: HistogramSnapshot
    prompt_tokens: int
    generation_tokens: int
    requests: int  # finished, any reason


class WindowStats(msgspec.Struct):
    """What happened between two samples (or over the whole window).
    Latencies are None when no request contributed one."""

    time_s: float  # wall clock at the end of the interval
    span_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    tokens_in_per_s: float
    tokens_out_per_s: float
    requests_per_s: float


class RollingStats:
    """Event-loop thread only. ``clock`` / ``wall`` are injectable for tests."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        *,
        peers: Any = None,
        interval_s: float = 2.0,
        window_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < interval_s < window_s:
            raise ValueError(f"need 0 < interval_s ({interval_s}) < window_s ({window_s})")
        self.metrics = metrics
        self.peers = peers  # a GatewayPeers: the others' published values join each sample
        self._base: _Sample | None = None  # a restarted gateway's predecessor's values
        if peers is not None:
            self._base = _convert(peers.predecessor("rolling"))
        self.interval_s, self.window_s = interval_s, window_s
        self._clock, self._wall = clock, wall
        self._samples: collections.deque[_Sample] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def ensure_started(self) -> None:
        """Start sampling on the running loop (once; a no-op without one).
        A timer chain rather than a task: nothing to cancel at shutdown."""
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.sample()
        self._timer = loop.call_later(self.interval_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.sample()
        except Exception:  # noqa: BLE001 - a bad sample must not end sampling
            logger.exception("rolling stats sample failed")
        self._timer = loop.call_later(self.interval_s, self._tick, loop)

    def sample(self) -> None:
        """Append the current cumulative values; drop samples older than the window."""
        self._samples.append(self._take())
        horizon = self._samples[-1].mono_s - self.window_s
        while len(self._samples) > 1 and self._samples[0].mono_s < horizon:
            self._samples.popleft()

    def series(self) -> list[WindowStats]:
        """One point per sampling interval in the window, oldest first."""
        samples = list(self._samples)
        return [_between(a, b) for a, b in zip(samples, samples[1:])]

    def window(self) -> WindowStats | None:
        """From the oldest sample in the window to now; None before the first sample."""
        if not self._samples:
            return None
        return _between(self._samples[0], self._take())

    def cumulative(self) -> dict[str, Any]:
        """This gateway's own cumulative values, as published to the others."""
        return msgspec.to_builtins(self._own())

    def _own(self) -> _Sample:
        m = self.metrics
        sample = _Sample(
            mono_s=self._clock(),
            wall_s=self._wall(),
            ttft=_merged(m.time_to_first_token),
            itl=_merged(m.inter_token_latency),
            prompt_tokens=m.num_prompt_tokens,
            generation_tokens=m.num_generation_tokens,
            requests=sum(m.num_finished.values()),
        )
        return sample if self._base is None else _sum(sample, self._base)

    def _take(self) -> _Sample:
        sample = self._own()
        if self.peers is None:
            return sample
        for record in self.peers.peers():
            other = _convert(record.get("rolling"))
            if other is not None:
                sample = _sum(sample, other)
        return sample


def _merged(histogram: PathHistogram) -> HistogramSnapshot:
    """All paths of ``histogram`` as one snapshot (same buckets)."""
    snaps = [h.snapshot() for h in histogram.by_path.values()]
    return HistogramSnapshot(
        list(histogram.bounds),
        [sum(col) for col in zip(*(s.bucket_counts for s in snaps))],
        sum(s.count for s in snaps),
        sum(s.sum for s in snaps),
    )


def _convert(published: Any) -> _Sample | None:
    """A gateway's published values; None if absent (an older gateway) or damaged."""
    if published is None:
        return None
    try:
        return msgspec.convert(published, _Sample)
    except (TypeError, msgspec.ValidationError):
        return None


def _sum(mine: _Sample, other: _Sample) -> _Sample:
    """``mine`` plus another gateway's values (its histograms only when their
    buckets are the same)."""

    def add(a: HistogramSnapshot, b: HistogramSnapshot) -> HistogramSnapshot:
        if a.bucket_upper_bounds != b.bucket_upper_bounds:
            return a
        counts = [x + y for x, y in zip(a.bucket_counts, b.bucket_counts)]
        return HistogramSnapshot(a.bucket_upper_bounds, counts, a.count + b.count, a.sum + b.sum)

    return _Sample(
        mono_s=mine.mono_s,
        wall_s=mine.wall_s,
        ttft=add(mine.ttft, other.ttft),
        itl=add(mine.itl, other.itl),
        prompt_tokens=mine.prompt_tokens + other.prompt_tokens,
        generation_tokens=mine.generation_tokens + other.generation_tokens,
        requests=mine.requests + other.requests,
    )


def _delta(new: HistogramSnapshot, old: HistogramSnapshot) -> HistogramSnapshot:
    """What ``new`` added to ``old``; at zero where a gateway restarted."""
    return HistogramSnapshot(
        new.bucket_upper_bounds,
        [max(a - b, 0) for a, b in zip(new.bucket_counts, old.bucket_counts)],
        max(new.count - old.count, 0),
        max(new.sum - old.sum, 0.0),
    )


def _between(old: _Sample, new: _Sample) -> WindowStats:
    span_s = max(new.mono_s - old.mono_s, 1e-9)
    ttft, itl = _delta(new.ttft, old.ttft), _delta(new.itl, old.itl)
    return WindowStats(
        time_s=new.wall_s,
        span_s=span_s,
        ttft_p50_s=quantile(ttft, 0.5),
        ttft_p99_s=quantile(ttft, 0.99),
        itl_p50_s=quantile(itl, 0.5),
        itl_p99_s=quantile(itl, 0.99),
        tokens_in_per_s=max(new.prompt_tokens - old.prompt_tokens, 0) / span_s,
        tokens_out_per_s=max(new.generation_tokens - old.generation_tokens, 0) / span_s,
        requests_per_s=max(new.requests - old.requests, 0) / span_s,
    )
