"""Per-request traces, phase histograms and request logs of the gateway, on
the NullBackend (an engine stand-in that reports timings like one): the span
tree and its attributes (SDK in-memory exporter), a caller's W3C
traceparent, the OTLP/HTTP export to a receiver started here, the
finished-request log line in both formats, and no SDK import when off."""

from __future__ import annotations

import gzip
import http.server
import io
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.cluster.observability.logging_setup import make_handler
from tandem.cluster.observability.tracing.otel import OtelTracer
from tandem.cluster.observability.tracing.settings import ObservabilityConfig, traces_url
from tandem.workers.checkpoints.tiny import build_tokenizer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def traced(tokenizer) -> Iterator[tuple[str, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer = OtelTracer(exporter=exporter)
    backend = NullBackend(tokenizer, output_interval_s=0.001)
    with serve_in_thread(create_app(backend, tracer=tracer)) as url:
        yield url, exporter
    tracer.shutdown()


def wait_spans(exporter: InMemorySpanExporter, num_spans: int) -> list:
    """Spans are exported when the request's response task ends, which may
    be just after the client has read the body."""
    deadline = time.monotonic() + DEADLINE_S
    while len(exporter.get_finished_spans()) < num_spans:
        assert time.monotonic() < deadline, exporter.get_finished_spans()
        time.sleep(0.01)
    return list(exporter.get_finished_spans())


def test_span_tree_of_a_local_request(traced):
    url, exporter = traced
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": True}
    with httpx.Client(timeout=DEADLINE_S) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            list(response.iter_lines())
    spans = {s.name: s for s in wait_spans(exporter, 6)}
    assert sorted(spans) == sorted(
        ["gateway", "tokenize", "prefill", "prefill.queue", "prefill.compute", "decode"]
    )
    root = spans["gateway"]
    assert root.parent is None
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}
    for name in ("tokenize", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id, name
    for name in ("prefill.queue", "prefill.compute"):
        assert spans[name].parent.span_id == spans["prefill"].context.span_id, name
    attributes = root.attributes
    assert attributes["tandem.request_id"].startswith("cmpl-")
    assert attributes["http.route"] == "/v1/completions"
    assert (attributes["tandem.path"], attributes["tandem.outcome"]) == ("local", "length")
    assert attributes["gen_ai.usage.output_tokens"] == 5
    for name in ("prefill", "decode"):
        engine = spans[name].attributes
        assert engine["tandem.engine.id"] == "null-0" and engine["tandem.engine.epoch"] == 0
    # times nest: every child inside the root, phases in order
    for span in spans.values():
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time, span.name
    assert spans["tokenize"].end_time <= spans["prefill"].start_time
    assert spans["prefill.queue"].end_time <= spans["prefill.compute"].start_time
    assert spans["prefill"].end_time <= spans["decode"].start_time


def test_incoming_traceparent_joins_the_callers_trace(traced):
    url, exporter = traced
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers=headers, timeout=DEADLINE_S
    )
    assert response.status_code == 200
    spans = wait_spans(exporter, 6)
    assert {format(s.context.trace_id, "032x") for s in spans} == {TRACE_ID}
    (root,) = [s for s in spans if s.name == "gateway"]
    assert format(root.parent.span_id, "016x") == PARENT_ID and root.parent.is_remote
    assert root.attributes["http.route"] == "/v1/chat/completions"
    # a malformed header is ignored: a new trace, the request is served
    exporter.clear()
    headers = {"traceparent": "00-not-a-trace-01"}
    response = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers=headers, timeout=DEADLINE_S
    )
    assert response.status_code == 200
    (root,) = [s for s in wait_spans(exporter, 6) if s.name == "gateway"]
    assert root.parent is None and format(root.context.trace_id, "032x") != TRACE_ID


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector's traces endpoint: decodes every POST."""

    received: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.server.received.append((self.path, self.headers["content-type"], request))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_export_over_otlp_http_to_a_local_receiver(tokenizer):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        tracer = OtelTracer(traces_url(endpoint))  # the batch processor, as `tandem serve`
        backend = NullBackend(tokenizer)
        with serve_in_thread(create_app(backend, tracer=tracer)) as url:
            headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3}
            response = httpx.post(
                f"{url}/v1/completions", json=body, headers=headers, timeout=DEADLINE_S
            )
            assert response.status_code == 200
            request_id = response.json()["id"]
        tracer.shutdown()  # flushes the batch
    finally:
        server.shutdown()
        thread.join(DEADLINE_S)
        server.server_close()
    spans, paths = [], set()
    for path, content_type, request in server.received:
        paths.add((path, content_type))
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}[
                "service.name"
            ]
            assert service == "tandem"
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
    assert paths == {("/v1/traces", "application/x-protobuf")}
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted(
        ["gateway", "tokenize", "prefill", "prefill.queue", "prefill.compute", "decode"]
    )
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}
    root = by_name["gateway"]
    assert root.parent_span_id.hex() == PARENT_ID
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["tandem.request_id"].string_value == request_id
    assert attributes["gen_ai.usage.output_tokens"].int_value == 3
    assert by_name["prefill"].parent_span_id == root.span_id


def test_phase_histograms_on_metrics(tokenizer):
    backend = NullBackend(tokenizer)
    with serve_in_thread(create_app(backend)) as url, httpx.Client(timeout=DEADLINE_S) as http:
        for _ in range(3):
            body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 4}
            assert http.post(f"{url}/v1/completions", json=body).status_code == 200
        text = http.get(f"{url}/metrics").text
    for family in ("request_queue_time", "request_prefill_time", "request_decode_time"):
        assert f'tandem:{family}_seconds_count{{path="local"}} 3.0' in text, family
        assert f'tandem:{family}_seconds_count{{path="remote"}} 0.0' in text, family
    assert "tandem:request_gateway_time_seconds_count 3.0" in text
    assert "tandem:kv_transfer_time_seconds_count 0.0" in text  # local requests only


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_request_log_lines_carry_the_request_id(tokenizer, log_format):
    stream = io.StringIO()
    handler = make_handler(log_format, stream)
    logger = logging.getLogger()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    backend = NullBackend(tokenizer)
    try:
        with serve_in_thread(create_app(backend)) as url:
            body = {"model": "tiny", "prompt": "hey", "max_tokens": 3}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S)
            request_id = response.json()["id"]
            deadline = time.monotonic() + DEADLINE_S
            while "request finished" not in stream.getvalue():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            logging.getLogger("tandem.cluster.gateway.app").warning("outside any request")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [line for line in stream.getvalue().splitlines() if line]
    (finished,) = [line for line in lines if "request finished" in line]
    (outside,) = [line for line in lines if "outside any request" in line]
    if log_format == "json":
        entry = json.loads(finished)
        assert entry["request_id"] == request_id and entry["logger"] == "tandem.request"
        assert (entry["path"], entry["outcome"], entry["output_tokens"]) == ("local", "length", 3)
        for key in ("queue_s", "prefill_s", "first_token_s", "decode_s", "total_s"):
            assert isinstance(entry[key], float) and entry[key] >= 0, key
        assert entry["transfer_s"] is None
        assert "request_id" not in json.loads(outside)
    else:
        assert f"[{request_id}] request finished path=local outcome=length" in finished
        assert " transfer_s=- " in finished and " total_s=" in finished
        assert "[" not in outside.split(" outside")[0]


def test_settings_are_checked():
    ObservabilityConfig(log_format="json", otlp_traces_endpoint="http://otel:4318")
    assert traces_url("http://otel:4318") == "http://otel:4318/v1/traces"
    assert traces_url("https://otel:4318/custom/path") == "https://otel:4318/custom/path"
    with pytest.raises(ValueError, match="log_format"):
        ObservabilityConfig(log_format="xml")
    for bad in ("otel:4318", "grpc://otel:4317", "http://", 5):
        with pytest.raises(ValueError, match="otlp_traces_endpoint"):
            ObservabilityConfig(otlp_traces_endpoint=bad)


def test_tracing_off_imports_no_sdk():
    code = (
        "import sys\n"
        "from tandem.cluster.gateway.app import create_app\n"
        "from tandem.cluster.gateway.null_backend import NullBackend\n"
        "from tandem.cluster.observability.tracing.settings import ObservabilityConfig, make_tracer\n"
        "from tandem.workers.checkpoints.tiny import build_tokenizer\n"
        "assert make_tracer(ObservabilityConfig()) is None\n"
        "create_app(NullBackend(build_tokenizer()))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
