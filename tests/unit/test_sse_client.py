"""benchmarks/_sse_client.py: the gateway benchmarks' lean client counts what the full one
decodes, wherever the reads split the stream, and refuses a stream that is short."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import _sse_client, serve_gateway  # noqa: E402
from tandem.cluster.cli.bench import BenchConfig, run_benchmark  # noqa: E402


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(tokens: int, events: int | None = None) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    token = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % tokens
    body = b"".join(_chunk(token) for _ in range(events or tokens))
    return head + body + _chunk(usage + b"data: [DONE]\n\n") + b"0\r\n\r\n"


def _feed(response: bytes, cuts: list[int], max_tokens: int) -> _sse_client._Stream:
    a, b = socket.socketpair()
    try:
        stream = _sse_client._Stream(
            a, _sse_client._Queue([b"GET / HTTP/1.1\r\n\r\n"], [max_tokens])
        )
        assert stream.send_next()
        pieces = [response[i:j] for i, j in zip([0, *cuts], [*cuts, len(response)], strict=True)]
        done = [stream.feed(piece, float(n + 1)) for n, piece in enumerate(pieces)]
        assert done == [False] * (len(pieces) - 1) + [True]
        return stream
    finally:
        a.close()
        b.close()


def test_every_split_of_a_stream_counts_the_same():
    """Cut the response into two reads at every byte, and into one read per byte: the events
    (tokens + usage + [DONE]) and the completion count come out the same; the first event's
    read is the TTFT's."""
    response = _response(5)
    for cut in range(1, len(response)):
        stream = _feed(response, [cut], 5)
        assert stream.events == 7
        assert stream.results[0][1] == 5
    per_byte = _feed(response, list(range(1, len(response))), 5)
    assert per_byte.events == 7
    first_event = response.index(b"data: ") + len(b"data: ")  # the read that completes it
    assert per_byte.results[0][0] == pytest.approx(first_event - per_byte.start_s)


def test_a_short_or_miscounted_stream_is_an_error():
    with pytest.raises(RuntimeError, match="events for 5 tokens"):
        _feed(_response(5, events=4), [], 5)
    with pytest.raises(RuntimeError, match=r"5 tokens \(6 asked\)"):
        _feed(_response(5), [], 6)
    a, b = socket.socketpair()
    try:
        stream = _sse_client._Stream(a, _sse_client._Queue([b"x"], [1]))
        stream.send_next()
        with pytest.raises(RuntimeError, match="HTTP/1.1 400"):
            stream.feed(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n", 0.0)
    finally:
        a.close()
        b.close()


def test_the_lean_client_counts_what_the_full_client_decodes():
    """Against the benchmark's own gateway process (the null backend): the same workload
    through both clients, the same output tokens."""
    proc, url = serve_gateway.start_server("gateway")
    try:
        config = BenchConfig(
            url,
            num_requests=12,
            concurrency=4,
            input_len=8,
            output_len=16,
            range_ratio=0.5,
            seed=3,
            request_timeout_s=60,
        )
        full = asyncio.run(run_benchmark(config))
        lean = _sse_client.run_raw_benchmark(config, 262, full["model"])
    finally:
        serve_gateway.stop_server(proc)
    assert full["num_failed"] == 0
    assert lean["total_output_tokens"] == full["total_output_tokens"] > 12 * 8


def test_a_connection_that_frees_takes_the_next_request():
    """The queue is shared: a connection whose request ends first takes the next one, so a
    connection held by a slower server process does not keep its own share waiting."""
    queue = _sse_client._Queue([b"r0", b"r1", b"r2"], [5, 5, 5])
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        fast, slow = (_sse_client._Stream(a, queue) for a, _ in pairs)
        assert fast.send_next() and slow.send_next()
        assert fast.feed(_response(5), 1.0)
        assert fast.send_next()  # the third request, while the slow one still runs
        assert slow.feed(_response(5), 2.0)
        assert not slow.send_next() and queue.next == 3
        assert [b.recv(64) for _, b in pairs] == [b"r0r2", b"r1"]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_ratios_pair_the_runs_of_one_repeat():
    """Each repeat's ratio is taken within the repeat (2, 4, 2: median 2); the ratio of
    each side's median (100 / 30) would mix runs from different minutes."""
    gateway = [{"tok_s": 200.0}, {"tok_s": 100.0}, {"tok_s": 60.0}]
    one = [{"tok_s": 100.0}, {"tok_s": 25.0}, {"tok_s": 30.0}]
    assert serve_gateway.paired_ratio(gateway, one) == 2.0
