"""Slow is not dead, on the real service (local Ray, one colocated engine).

An engine process paused with SIGSTOP stops answering Ray and stops its
heartbeats. Paused for longer than a Ray call timeout (1 s here) but less
than ``engine_dead_after_s`` (8 s here) it is slow: its requests complete
after SIGCONT. Paused for longer, it is dead: its requests end with an error;
when it comes back it is told to abort them (no orphan computes for nobody).
Also: the gateway's output reader killed and restarted, and a stream whose
consumer stops reading (cut after a bounded backlog, aborted on the engine).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tests import shared_ray

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16, "max_model_len": 1024}
DEAD_AFTER_S = 8.0
PROMPT = "Slow is not dead"


@pytest.fixture(scope="module")
def svc():
    shared_ray.start()
    config = serve_config(
        ray_dashboard=False,
        model="tiny",
        colocated=1,
        engine_dead_after_s=DEAD_AFTER_S,
        engine_call_timeout_s=1.0,
        # one engine: a dead one's streams end with an error here (the
        # --no-migration path); migration is tests/chaos/'s subject
        migration=False,
        **ENGINE,
    )
    try:
        with ServiceThread(config) as service:
            yield service
    finally:
        shared_ray.release()


def engine(svc):
    return svc.service.backend.engines["colocated-0"]


def wait_for(condition, deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"{what}: not within {deadline_s} s"
        time.sleep(0.05)


def health_code(svc) -> int:
    return httpx.get(svc.base_url + "/health", timeout=5).status_code


def wait_idle(svc, deadline_s: float = 60.0) -> None:
    def idle() -> bool:
        stats = svc.run(svc.service.backend.call_all("stats"))
        return not any(
            s.scheduler.num_running_reqs or s.scheduler.num_waiting_reqs for s in stats.values()
        )

    wait_for(idle, deadline_s, "engine idle")
    assert all(svc.run(svc.service.backend.call_all("check_integrity")).values())


class Stream(threading.Thread):
    """One streamed completion in a thread; ``events`` collects its data lines."""

    def __init__(self, svc, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = svc.base_url + "/v1/completions"
        self.body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        self.events: list[str] = []
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()
        self.started.set()

    def finish(self, timeout_s: float = 120.0) -> list[str]:
        self.join(timeout_s)
        assert not self.is_alive(), "stream did not end"
        return self.events


def completion_tokens(events: list[str]) -> int:
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])["usage"]["completion_tokens"]


def test_paused_shorter_than_dead_timeout_requests_complete(svc):
    e = engine(svc)
    pid = e.state.info["pid"]
    streams = [Stream(svc, 300) for _ in range(3)]
    for s in streams:
        assert s.started.wait(60)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(1.5)
        wait_for(lambda: e.health.seconds_since_heartbeat() > 2.5, 10, "heartbeats stop")
        assert health_code(svc) == 200  # slow, not dead
        assert e.state.ready
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [completion_tokens(s.finish()) for s in streams] == [300, 300, 300]
    assert svc.service.backend.members.num_orphans_aborted == 0
    assert e.state.ready
    wait_idle(svc)


def test_paused_past_dead_timeout_fails_then_holds_no_orphan(svc):
    e = engine(svc)
    backend = svc.service.backend
    pid = e.state.info["pid"]
    epoch = e.state.epoch
    streams = [Stream(svc, 900) for _ in range(2)]
    for s in streams:
        assert s.started.wait(60)
    os.kill(pid, signal.SIGSTOP)
    try:
        start_s = time.monotonic()
        for s in streams:
            events = s.finish(DEAD_AFTER_S + 30)
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert "colocated-0 failed" in error["message"]
        assert time.monotonic() - start_s >= DEAD_AFTER_S - 1.0
        assert not e.state.ready
        assert health_code(svc) == 503
        assert len(e.health.orphans) == 2
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: health_code(svc) == 200, 30, "engine back")
    assert e.state.epoch == epoch  # the same incarnation, not a restart
    assert backend.members.num_orphans_aborted == 2 and not e.health.orphans
    wait_idle(svc)
    r = httpx.post(
        svc.base_url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert r.json()["usage"]["completion_tokens"] == 4


def test_killed_output_reader_fails_streams_then_recovers(svc):
    backend = svc.service.backend
    backend.plane.reader_restart_delay_s = 3.0  # long enough to observe the 503
    num_restarts = backend.plane.num_reader_restarts
    stream = Stream(svc, 900)
    assert stream.started.wait(60)
    svc.loop.call_soon_threadsafe(backend.plane.reader_task.cancel)
    events = stream.finish(30)
    assert events[-1] == "[DONE]"
    assert "output reader failed" in json.loads(events[-2])["error"]["message"]
    assert health_code(svc) == 503
    wait_for(lambda: health_code(svc) == 200, 30, "reader restarted")
    assert backend.plane.num_reader_restarts == num_restarts + 1
    r = httpx.post(
        svc.base_url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert r.json()["usage"]["completion_tokens"] == 4
    wait_idle(svc)


def test_consumer_that_stops_reading_is_cut_and_others_stream(svc):
    """A response task blocked in its HTTP send stops taking outputs; here
    the consumer of ``generate`` takes the first output and then waits, as a
    send to a client that never reads would (over TCP on loopback the kernel
    buffers hold megabytes, more than a tiny-model request produces, so a
    real socket would not reach the bound within this test). Its backlog
    passes the bound: the stream is cut, the consumer cancelled, the request
    aborted on the engine (it ends idle), and a stream beside it completes."""
    backend = svc.service.backend
    backend.plane.max_queued_outputs = 16
    num_cut = backend.plane.num_streams_cut
    request = EngineRequest(
        "stalled-consumer",
        backend.tokenizer.encode(PROMPT),
        SamplingParams(max_tokens=900, ignore_eos=True),
    )

    async def stalled_consumer() -> str:
        outputs = backend.generate(request)
        try:
            await anext(outputs)
            await asyncio.sleep(120)  # a send that never completes
            return "not cut"
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            await outputs.aclose()

    try:
        future = asyncio.run_coroutine_threadsafe(stalled_consumer(), svc.loop)
        other = Stream(svc, 200)
        assert future.result(120) == "cancelled"
        assert backend.plane.num_streams_cut == num_cut + 1
        assert completion_tokens(other.finish(120)) == 200
    finally:
        backend.plane.max_queued_outputs = 512
    wait_idle(svc)


def test_http_client_that_never_reads_is_cut(svc):
    """The same bound over a real HTTP connection: a client that sends a
    streamed request and then never reads. Small socket buffers on both ends
    (the listener's SO_SNDBUF is inherited by accepted connections) make the
    server's send block after ~100 KB instead of megabytes; the outputs then
    pile up behind it until the bound cuts the stream, the request is aborted
    on the engine and a stream beside it completes."""
    import socket

    backend = svc.service.backend
    backend.plane.max_queued_outputs = 16
    num_cut = backend.plane.num_streams_cut
    listener = svc._sock
    sndbuf = listener.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    body = json.dumps(
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    ).encode()
    host, port = svc.base_url.removeprefix("http://").split(":")
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        client.connect((host, int(port)))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: backend.plane.num_streams_cut > num_cut, 120, "never-reading client cut")
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        other = Stream(svc, 200)
        assert completion_tokens(other.finish(120)) == 200
    finally:
        client.close()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        backend.plane.max_queued_outputs = 512
    wait_idle(svc)
    # nothing of the cut stream is kept: its output queue went with it
    wait_for(lambda: not backend.plane.streams, 10, "per-request queues released")
