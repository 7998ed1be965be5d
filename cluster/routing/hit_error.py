"""Predicted vs actual prefix hit, per request: the router's prediction
(from the cluster index) minus the hit the engine reported on its first
output, in tokens. Positive: the router expected more than the engine had
(an eviction or a lost event); negative: less (an event not yet seen)."""

from __future__ import annotations

from tandem.scheduler.engine_stats import Histogram, HistogramSnapshot

# symmetric buckets in tokens around 0 (exact prediction)
ERROR_BOUNDS_TOKENS = (-1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 16.0, 64.0, 256.0, 1024.0)


class HitErrorHistogram:
    """Counts on the gateway's one ``Histogram``, plus exact predictions."""

    def __init__(self) -> None:
        self._hist = Histogram(ERROR_BOUNDS_TOKENS)
        self.num_exact = 0

    @property
    def count(self) -> int:
        return sum(self._hist.counts)

    @property
    def sum(self) -> float:
        return self._hist.sum

    def observe(self, predicted_tokens: int, actual_tokens: int) -> None:
        err = predicted_tokens - actual_tokens
        self._hist.observe(err)
        self.num_exact += err == 0

    def snapshot(self) -> HistogramSnapshot:
        """Cumulative bucket counts (the engines' convention); +Inf is ``count``."""
        return self._hist.snapshot()
