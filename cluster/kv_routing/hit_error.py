"""Predicted vs actual prefix hit, per request: the router's prediction
(from the cluster index) minus the hit the engine reported on its first
output, in tokens. Positive: the router expected more than the engine had
(an eviction or a lost event); negative: less (an event not yet seen)."""

from __future__ import annotations

from cluster.backend import HistogramSnapshot

# symmetric buckets in tokens around 0 (exact prediction)
ERROR_BOUNDS_TOKENS = (-1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 16.0, 64.0, 256.0, 1024.0)


class HitErrorHistogram:
    def __init__(self) -> None:
        self.counts = [0] * len(ERROR_BOUNDS_TOKENS)
        self.count = 0
        self.sum = 0.0
        self.num_exact = 0

    def observe(self, predicted_tokens: int, actual_tokens: int) -> None:
        err = predicted_tokens - actual_tokens
        self.count += 1
        self.sum += err
        self.num_exact += err == 0
        for i, bound in enumerate(ERROR_BOUNDS_TOKENS):
            if err <= bound:
                self.counts[i] += 1  # cumulative, as Prometheus buckets

    def snapshot(self) -> HistogramSnapshot:
        """Cumulative bucket counts (the engines' convention); +Inf is ``count``."""
        return HistogramSnapshot(
            bucket_upper_bounds=list(ERROR_BOUNDS_TOKENS),
            bucket_counts=list(self.counts),
            count=self.count,
            sum=self.sum,
        )
