"""TTFT/ITL percentiles, throughput and goodput of a simulated run.

Goodput counts requests that meet both SLOs per second of the run, as
``vllm bench serve --goodput`` and ``tandem bench`` count them: TTFT (arrival
to first token) within ``ttft_slo_ms`` and TPOT (the request's mean gap
between tokens after the first) within ``itl_slo_ms``. The run lasts from the
first arrival to the last token."""

from __future__ import annotations

from typing import Any


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    rank = (len(sorted_values) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def stats_ms(values_s: list[float]) -> dict[str, float]:
    """Mean, percentiles and max in ms of durations in seconds (``tandem bench`` reports the
    same fields for a real run)."""
    values = sorted(v * 1000.0 for v in values_s)
    mean = sum(values) / len(values) if values else float("nan")
    return {
        "mean": mean,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "p99.9": percentile(values, 99.9),
        "max": values[-1] if values else float("nan"),
    }


def summarize(
    records: list[Any], ttft_slo_ms: float | None = None, itl_slo_ms: float | None = None
) -> dict[str, Any]:
    done = [r for r in records if not r.error and r.token_times]
    ttfts = [r.token_times[0] - r.arrival_s for r in done]
    itls = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.token_times[-1] for r in done), default=start)
    duration = max(end - start, 1e-9)
    num_good = sum(1 for r in done if _meets(r, ttft_slo_ms, itl_slo_ms))
    out_tokens = sum(len(r.token_times) for r in done)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": out_tokens / duration,
        "goodput": num_good / duration,
        "num_good": num_good,
        "ttft_slo_ms": ttft_slo_ms,
        "itl_slo_ms": itl_slo_ms,
        "ttft_ms": stats_ms(ttfts),
        "itl_ms": stats_ms(itls),
    }


def _meets(r: Any, ttft_slo_ms: float | None, itl_slo_ms: float | None) -> bool:
    if ttft_slo_ms is not None and (r.token_times[0] - r.arrival_s) * 1000.0 > ttft_slo_ms:
        return False
    n = len(r.token_times)
    if itl_slo_ms is not None and n > 1:
        tpot = (r.token_times[-1] - r.token_times[0]) / (n - 1)
        if tpot * 1000.0 > itl_slo_ms:
            return False
    return True


def ttft_parts(records: list[Any]) -> dict[str, float]:
    """Where the median request's time to first token went, in ms (medians of
    each part over the completed requests): ``path`` the serving path's
    latency before an engine has it (the profile's ``request_latency_s``),
    ``queue`` from then until the step that first computes its prompt starts,
    ``step`` from that step's start to its first token (the prefill step and
    the loop's overhead, stretched by the cores' other work; several steps for
    a prompt split in chunks). benchmarks/simulator.py prints them beside a
    real run's."""
    done = [r for r in records if not r.error and r.token_times and r.first_step_s is not None]
    parts = {
        "path": [r.entry_s - r.arrival_s for r in done],
        "queue": [r.first_step_s - r.entry_s for r in done],
        "step": [r.token_times[0] - r.first_step_s for r in done],
        "ttft": [r.token_times[0] - r.arrival_s for r in done],
    }
    return {k: stats_ms(v)["p50"] for k, v in parts.items()}
