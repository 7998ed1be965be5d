"""The soak benchmark's short form: 1,000 requests through a real service
(1 prefill + 1 decode engine, tiny model; streams and not, 10% dropped by
the client) with no error, no block held afterwards and every engine's
``check_integrity()``. No timing is asserted (benchmarks/soak.py prints it)."""

from __future__ import annotations

import pytest

from benchmarks.soak import SoakConfig, format_report, run_soak, summarize

pytestmark = pytest.mark.slow


def test_soak_1000_requests_no_error_no_leak():
    config = SoakConfig(
        num_requests=1000, concurrency=32, max_prompt_words=30, max_output_tokens=12
    )
    report = run_soak(config)
    print(format_report(report))
    summary = summarize(report)
    assert summary["num_requests"] == 1000
    assert summary["num_errors"] == 0, summary["error_samples"]
    assert 50 <= summary["num_dropped"] <= 150  # the client really dropped ~10%
    assert summary["busy_at_end"] == {}
    assert summary["blocks_held"] == {"prefill-0": 0, "decode-0": 0}
    assert summary["integrity"] == {"prefill-0": True, "decode-0": True}
    assert summary["gateway_in_flight"] == 0
    # every request the gateway took ended: run to length, or aborted when its client left
    finished = summary["gateway_finished"]
    assert set(finished) <= {"length", "abort"}, finished
    assert 0 < finished.get("abort", 0) <= summary["num_dropped"]
