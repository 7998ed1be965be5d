"""Speculative decoding's metrics: vLLM's names under ``tandem:``, from the engines'
``SchedulerStats`` (engines that never drafted export none), and the dashboard's
acceptance column."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tandem.cluster.gateway.backend import BackendMetrics, EngineMetrics
from tandem.cluster.observability.dashboard.state import _engine
from tandem.cluster.observability.metrics import EngineMetricsCollector, render
from tandem.scheduler.engine_stats import EngineStats
from tandem.wire.engine_protocol import SchedulerStats


class _Backend:
    def __init__(self, engines: list[EngineMetrics]) -> None:
        self.engines = engines

    def metrics_snapshot(self) -> BackendMetrics:
        return BackendMetrics(self.engines, {})


def _engine_metrics(engine_id: str, stats: SchedulerStats) -> EngineMetrics:
    return EngineMetrics(EngineStats(engine_id, "decode", 1, scheduler=stats), epoch=1)


def test_spec_decode_counters_and_acceptance():
    speculating = SchedulerStats(
        spec_decode_num_drafts=10,
        spec_decode_num_draft_tokens=40,
        spec_decode_num_accepted_tokens=25,
        spec_decode_num_accepted_tokens_per_pos=[9, 7, 5, 4],
    )
    engines = [_engine_metrics("d0", speculating), _engine_metrics("d1", SchedulerStats())]
    registry = CollectorRegistry()
    registry.register(EngineMetricsCollector(_Backend(engines)))
    text = render(registry).decode()
    labels = 'engine="d0",role="decode"'
    for line in (
        f"tandem:spec_decode_num_drafts_total{{{labels}}} 10.0",
        f"tandem:spec_decode_num_draft_tokens_total{{{labels}}} 40.0",
        f"tandem:spec_decode_num_accepted_tokens_total{{{labels}}} 25.0",
        'tandem:spec_decode_num_accepted_tokens_per_pos_total{engine="d0",position="0",role="decode"} 9.0',
        'tandem:spec_decode_num_accepted_tokens_per_pos_total{engine="d0",position="3",role="decode"} 4.0',
    ):
        assert line in text
    assert 'engine="d1"' not in "".join(x for x in text.splitlines() if "spec_decode" in x)
    assert _engine(engines[0]).spec_acceptance == 25 / 40
    assert _engine(engines[1]).spec_acceptance == -1.0
