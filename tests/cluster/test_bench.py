"""``tandem bench`` against the gateway + NullBackend in a background server."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from tandem.cluster.cli import bench
from tandem.cluster.cli.bench import BenchConfig
from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.cluster.planner import metrics
from tandem.workers.checkpoints.tiny import build_tokenizer


@pytest.fixture(scope="module")
def server():
    backend = NullBackend(build_tokenizer(), num_tokens_per_output=2)
    with serve_in_thread(create_app(backend)) as url:
        yield backend, url


def run(config: BenchConfig) -> dict:
    return asyncio.run(bench.run_benchmark(config))


def test_closed_loop_numbers_are_sane(server):
    backend, url = server
    summary = run(
        BenchConfig(url, num_requests=24, concurrency=4, input_len=16, output_len=20, seed=3)
    )
    assert (summary["num_completed"], summary["num_failed"]) == (24, 0)
    assert summary["model"] == "tiny"
    assert summary["total_input_tokens"] == 24 * 16
    assert summary["total_output_tokens"] == 24 * 20  # ignore_eos: exactly max_tokens
    duration_s = summary["duration_s"]
    assert 0 < duration_s < 30
    assert summary["request_throughput"] == pytest.approx(24 / duration_s)
    assert summary["output_token_throughput"] == pytest.approx(24 * 20 / duration_s)
    ttft, tpot, itl, e2e = (summary[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
    for stats in (ttft, tpot, itl, e2e):
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["p99.9"] <= stats["max"]
    assert 0 < ttft["p50"] <= e2e["p50"]
    assert e2e["p99"] < duration_s * 1000
    assert tpot["mean"] > 0
    assert summary["goodput"] is None
    # a client has its last event before the server finishes the request's
    # cleanup: wait (bounded) for every request to leave the backend
    deadline = time.monotonic() + 10
    while backend.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.num_running == 0


def test_goodput_counts_requests_meeting_slos(server):
    _, url = server
    lax = run(
        BenchConfig(
            url,
            num_requests=8,
            concurrency=2,
            input_len=4,
            output_len=4,
            slo_ttft_ms=60_000,
            slo_tpot_ms=60_000,
        )
    )
    assert lax["goodput"] == pytest.approx(lax["request_throughput"])
    strict = run(
        BenchConfig(url, num_requests=8, concurrency=2, input_len=4, output_len=4, slo_ttft_ms=1e-6)
    )
    assert strict["goodput"] == 0.0


def test_poisson_rate_and_range_ratio(server):
    _, url = server
    config = BenchConfig(
        url,
        num_requests=16,
        request_rate=400.0,
        input_len=10,
        output_len=10,
        range_ratio=0.5,
        seed=7,
    )
    prompts, output_lens, offsets_s = bench.build_workload(config, vocab_size=262)
    assert all(5 <= len(p) <= 15 for p in prompts) and all(5 <= n <= 15 for n in output_lens)
    assert offsets_s[0] == 0.0 and offsets_s == sorted(offsets_s)
    assert bench.build_workload(config, vocab_size=262) == (prompts, output_lens, offsets_s)
    summary = run(config)
    assert summary["num_completed"] == 16
    assert summary["total_input_tokens"] == sum(len(p) for p in prompts)
    assert summary["total_output_tokens"] == sum(output_lens)
    assert summary["duration_s"] >= offsets_s[-1]


def test_timeout_bounds_the_run():
    backend = NullBackend(build_tokenizer(), output_interval_s=10.0)
    with serve_in_thread(create_app(backend)) as url:
        summary = run(
            BenchConfig(
                url,
                num_requests=3,
                concurrency=3,
                input_len=2,
                output_len=50,
                request_timeout_s=0.3,
            )
        )
        assert summary["num_failed"] == 3
        assert summary["errors"] == {"timeout after 0.3 s": 3}
        assert summary["duration_s"] < 5


def test_server_errors_are_reported(server):
    _, url = server
    summary = run(BenchConfig(url, num_requests=2, input_len=5000, output_len=4))
    assert summary["num_failed"] == 2
    [error] = summary["errors"]
    assert error.startswith("HTTP 400")


def test_main_json_and_table(server, capsys):
    _, url = server
    args = ["--url", url, "--num-requests", "4", "--input-len", "3", "--output-len", "5"]
    assert bench.main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_completed"] == 4
    assert bench.main([*args, "--slo-ttft-ms", "60000"]) == 0
    table = capsys.readouterr().out
    for label in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "output throughput"):
        assert label in table
    assert bench.main([*args, "--concurrency", "0"]) == 2


def test_percentile_matches_definition():
    values = sorted(random.Random(0).random() for _ in range(101))
    assert metrics.percentile(values, 50) == values[50]
    assert metrics.percentile(values, 99) == values[99]
    assert metrics.percentile([1.0, 2.0], 50) == 1.5


def test_stats_tail_columns():
    # 1001 values 0..1000 ms, shuffled: p99.9 is the 1000th value, max the last
    values_s = [i / 1000.0 for i in range(1001)]
    random.Random(1).shuffle(values_s)
    stats = metrics.stats_ms(values_s)
    assert stats["p99"] == pytest.approx(990.0)
    assert stats["p99.9"] == pytest.approx(999.0)
    assert stats["max"] == pytest.approx(1000.0)
    assert stats["mean"] == pytest.approx(500.0)


def test_trace_replay_sends_every_row_at_its_time(server, tmp_path):
    _, url = server
    rows = [
        {"timestamp": 0, "input_length": 12, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 400, "input_length": 9, "output_length": 2, "hash_ids": [1]},
        {"timestamp": 800, "input_length": 5, "output_length": 4},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run(BenchConfig(url=url, trace=str(path), time_scale=0.5, trace_block_tokens=4))
    assert summary["num_requests"] == 3 and summary["num_completed"] == 3
    assert summary["total_input_tokens"] == 12 + 9 + 5
    assert summary["duration_s"] >= 0.4  # the last row is sent at 0.8 s x 0.5
    assert summary["trace"] == str(path)
    assert "prefix hit rate" in bench.format_table(summary)


def test_building_the_cli_parser_imports_no_aiohttp():
    """Every ``tandem`` command builds the parser, ``bench``'s arguments included; aiohttp
    (0.3 s to import) is imported only by a bench run."""
    import subprocess
    import sys

    code = (
        "import sys; from tandem.cluster.cli.main import build_parser; build_parser(); "
        "print('aiohttp' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
