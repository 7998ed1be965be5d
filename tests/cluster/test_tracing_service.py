"""One remote (P -> D) request through a real 1 prefill + 1 decode service
on a local Ray: its trace shows where its time went across both engines,
its phases reach /metrics, and its finished line is logged."""

from __future__ import annotations

import io
import json
import logging
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.cluster.observability.logging_setup import make_handler
from tandem.cluster.observability.tracing.otel import OtelTracer
from tests.cluster.service_helpers import client, tiny_pd_service, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]
DEADLINE_S = 60.0


def test_trace_of_a_remote_request_spans_both_engines():
    exporter = InMemorySpanExporter()
    stream = io.StringIO()
    request_log = logging.getLogger("tandem.request")
    handler = make_handler("json", stream)
    request_log.addHandler(handler)
    old_level = request_log.level
    request_log.setLevel(logging.INFO)
    try:
        with tiny_pd_service(tracer=OtelTracer(exporter=exporter)) as svc:
            prompt = "the quick brown fox " * 16  # >= 32 tokens: remote prefill
            response = client(svc).completions.create(model="tiny", prompt=prompt, max_tokens=6)
            num_prompt_tokens = response.usage.prompt_tokens
            deadline = time.monotonic() + DEADLINE_S
            while not any(s.name == "gateway" for s in exporter.get_finished_spans()):
                assert time.monotonic() < deadline, "no trace"
                time.sleep(0.05)
            metrics = httpx.get(svc.base_url + "/metrics", timeout=30).text
            wait_idle(svc)
    finally:
        request_log.removeHandler(handler)
        request_log.setLevel(old_level)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == sorted(
        [
            "gateway",
            "tokenize",
            "prefill",
            "prefill.queue",
            "prefill.compute",
            "kv_transfer",
            "decode",
        ]
    )
    root = spans["gateway"]
    assert root.attributes["tandem.path"] == "remote"
    assert root.attributes["tandem.request_id"] == response.id
    prefill, transfer, decode = spans["prefill"], spans["kv_transfer"], spans["decode"]
    assert prefill.attributes["tandem.engine.id"] == "prefill-0"
    assert prefill.attributes["tandem.engine.role"] == "prefill"
    assert prefill.attributes["tandem.engine.epoch"] > 0
    for span in (transfer, decode):
        assert span.attributes["tandem.engine.id"] == "decode-0"
        assert span.attributes["tandem.engine.epoch"] > 0
    blocks = transfer.attributes["tandem.kv.num_blocks"]
    assert blocks == -(-num_prompt_tokens // 16)  # every prompt block read from P
    assert transfer.attributes["tandem.kv.num_bytes"] > 0
    assert 1 <= transfer.attributes["tandem.kv.num_descriptors"] <= blocks
    assert transfer.attributes["tandem.kv.source_engine_id"] == "prefill-0"
    assert (
        transfer.attributes["tandem.kv.source_engine_epoch"]
        == (prefill.attributes["tandem.engine.epoch"])
    )
    # one tree, in time order: P computes, then D reads, then D decodes
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}
    for span in spans.values():
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time, span.name
    assert prefill.end_time <= transfer.start_time <= transfer.end_time <= decode.start_time
    for family in ("request_queue_time", "request_prefill_time", "request_decode_time"):
        assert f'tandem:{family}_seconds_count{{path="remote"}} 1.0' in metrics, family
    assert "tandem:kv_transfer_time_seconds_count 1.0" in metrics
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines() if "request finished" in x]
    assert (line["request_id"], line["path"], line["output_tokens"]) == (response.id, "remote", 6)
    assert all(line[k] >= 0 for k in ("queue_s", "prefill_s", "transfer_s", "decode_s"))
