"""A lean streaming client for the gateway benchmarks: HTTP/1.1 on a plain epoll loop.

``cluster.cli.bench`` (aiohttp, every event decoded with msgspec) spends 8-20 us
of CPU per token. On a box with few cores that client shares them with the
servers it measures, so two gateway processes beside it are three busy
processes on two cores, and on 16 cores one client process held four gateways
at 2.25x one. This client does per read what the servers' measurement needs
and nothing more: it counts the SSE events in the bytes (``bytes.count``, in C),
takes the first event's time for TTFT and reads the usage chunk's
``completion_tokens`` at the end. Each of ``concurrency`` connections runs its
next request from one shared queue when its last one ends, on one keep-alive
connection, as aiohttp's pool does under the bench's semaphore. (A fixed share
per connection would leave the gateway process that SO_REUSEPORT gave fewer
connections idle at the end while the other works.)

The workload (prompts, lengths, seed) is ``cluster.cli.bench.build_workload``'s,
so both clients send the same requests. A request fails unless its response is
200, chunked, ends with ``[DONE]`` and the terminating chunk, and carries one
event per output token (the usage's count) plus the usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import json
import re
import selectors
import socket
import statistics
import time
from urllib.parse import urlsplit

from tandem.cluster.cli.bench import BenchConfig, build_workload, stream_payload

_EVENT = b"data: "
_END = b"data: [DONE]\n\n\r\n0\r\n\r\n"  # the last event, then the terminating chunk
_KEEP = 1024  # bytes kept from the end: the usage chunk, [DONE], the last chunk
_READ = 1 << 15  # under malloc's mmap threshold: a larger buffer costs an mmap per read
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


class _Queue:
    """The workload's requests in order; each connection takes the next as it frees."""

    def __init__(self, requests: list[bytes], max_tokens: list[int]):
        self.requests, self.max_tokens = requests, max_tokens
        self.next = 0

    def take(self) -> tuple[bytes, int] | None:
        if self.next == len(self.requests):
            return None
        self.next += 1
        return self.requests[self.next - 1], self.max_tokens[self.next - 1]


class _Stream:
    """One keep-alive connection running requests one after another, each taken from
    the shared queue when the last one ends (a semaphore over a pool, as aiohttp's)."""

    def __init__(self, sock: socket.socket, queue: _Queue):
        self.sock, self.queue = sock, queue
        self.results: list[tuple[float, int]] = []

    def send_next(self) -> bool:
        """Send the next request; False when none is left."""
        taken = self.queue.take()
        if taken is None:
            return False
        request, self.expect = taken
        self.head = b""  # the status line and headers, until seen whole
        self.in_body = False
        self.events = 0
        self.first_s = 0.0
        self.tail = b""  # the last bytes read (the end of the stream, its usage)
        self.start_s = time.perf_counter()
        self.sock.sendall(request)  # a few hundred bytes: never blocks
        return True

    def feed(self, data: bytes, now_s: float) -> bool:
        """Take what a read returned; True when the response is complete."""
        if not self.in_body:
            self.head += data
            split = self.head.find(b"\r\n\r\n")
            if split < 0:
                return False
            head, data = self.head[:split], self.head[split + 4 :]
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
            if b"transfer-encoding: chunked" not in head.lower():
                raise RuntimeError("the stream is not chunked")
            self.in_body = True
        # a marker split over two reads lies within the last 5 bytes of one and the first 5
        # of the next, which together hold no marker that either holds alone
        count = data.count(_EVENT) + (self.tail[-5:] + data[:5]).count(_EVENT)
        if count and not self.first_s:
            self.first_s = now_s
        self.events += count
        self.tail = (self.tail + data)[-_KEEP:]
        if not self.tail.endswith(_END):
            return False
        match = _COMPLETION_TOKENS.search(self.tail)
        if match is None:
            raise RuntimeError("no usage in the stream")
        tokens, expect = int(match.group(1)), self.expect
        if tokens != expect or self.events != tokens + 2:
            raise RuntimeError(f"{self.events} events for {tokens} tokens ({expect} asked)")
        self.results.append((self.first_s - self.start_s, tokens))
        return True


def _run(streams: list[_Stream], timeout_s: float) -> None:
    """Every stream's requests to the end: one epoll loop reading each socket as its
    bytes come, as a client across a network would."""
    selector = selectors.DefaultSelector()
    for stream in streams:
        if stream.send_next():
            selector.register(stream.sock, selectors.EVENT_READ, stream)
    deadline_s = time.monotonic() + timeout_s
    try:
        while selector.get_map():
            ready = selector.select(timeout=1.0)
            if not ready and time.monotonic() > deadline_s:
                raise TimeoutError(f"no response within {timeout_s} s")
            now_s = time.perf_counter()
            for key, _ in ready:
                stream = key.data
                data = stream.sock.recv(_READ)
                if not data:
                    raise ConnectionError("the server closed a connection mid-response")
                if stream.feed(data, now_s):
                    deadline_s = time.monotonic() + timeout_s
                    if not stream.send_next():
                        selector.unregister(stream.sock)
    finally:
        selector.close()
        for stream in streams:
            stream.sock.close()


def _raw_request(address: tuple[str, int], body: dict) -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def run_raw_benchmark(config: BenchConfig, vocab_size: int, model: str) -> dict:
    """The closed-loop workload of ``config`` (``concurrency`` streams); a summary with
    ``run_benchmark``'s keys that the gateway benchmarks read."""
    config.validate()
    url = urlsplit(config.url)
    address = (url.hostname or "127.0.0.1", url.port or 80)
    prompts, output_lens, _ = build_workload(config, vocab_size)
    requests = [
        _raw_request(address, stream_payload(model, prompt, n, True))
        for prompt, n in zip(prompts, output_lens, strict=True)
    ]
    count = min(config.concurrency or 8, len(requests))
    start_s = time.perf_counter()
    queue = _Queue(requests, output_lens)
    streams = []
    for _ in range(count):
        sock = socket.create_connection(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        streams.append(_Stream(sock, queue))
    _run(streams, config.request_timeout_s)
    duration_s = time.perf_counter() - start_s
    results = [result for stream in streams for result in stream.results]
    total = sum(tokens for _, tokens in results)
    return {
        "num_failed": 0,  # a failure raises: the benchmark stops with it
        "errors": [],
        "total_output_tokens": total,
        "output_token_throughput": total / duration_s,
        "ttft_ms": {"p50": statistics.median(ttft for ttft, _ in results) * 1e3},
    }
