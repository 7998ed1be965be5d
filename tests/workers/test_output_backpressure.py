"""Backpressure on an engine's output socket: a gateway PULL that stops
reading slows the engine down (it stops stepping, its send queue stays
bounded, it keeps answering control calls); when the gateway reads again
nothing was lost; a gateway that reads nothing past the stall timeout gets
every stream cut with an error and the engine frees everything."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
import zmq

from tandem.cluster.engines.actor import free_port
from tandem.wire.engine_protocol import EngineOutputs, EngineRequest, FinishReason, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tandem.workers.engine.service import EngineService

pytestmark = pytest.mark.slow  # an engine loop on real sockets, ~20 s

NUM_REQUESTS = 16
MAX_TOKENS = 150
LOGPROBS = 20  # ~250 bytes per token: outputs outgrow the socket buffers fast
BACKLOG = 4


class Gateway:
    """The gateway's two sockets, with a PULL that holds as little as ZMQ
    allows; outputs over a Unix socket (fixed kernel buffers, unlike TCP's
    autotuned ones)."""

    def __init__(self, ipc_path: str) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 1)
        self.pull.setsockopt(zmq.RCVBUF, 4096)
        self.out_addr = f"ipc://{ipc_path}"
        self.pull.bind(self.out_addr)
        self.in_addr = f"tcp://127.0.0.1:{free_port()}"
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.tokens: dict[str, int] = {}
        self.finals: dict[str, object] = {}
        self._dec = msgspec.msgpack.Decoder(EngineOutputs)

    def send(self, req: EngineRequest) -> None:
        self.push.send_multipart([b"R", msgspec.msgpack.encode(req)])

    def read_until_finished(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.finals) < NUM_REQUESTS:
            assert time.monotonic() < deadline, f"{len(self.finals)} of {NUM_REQUESTS} finished"
            if not self.pull.poll(100):
                continue
            kind, payload = self.pull.recv_multipart()
            if kind != b"O":
                continue
            for out in self._dec.decode(payload).outputs:
                self.tokens[out.request_id] = self.tokens.get(out.request_id, 0) + len(
                    out.new_token_ids
                )
                if out.finish_reason is not None:
                    self.finals[out.request_id] = out

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()


@pytest.fixture
def served(tiny_model_dir, ipc_dir, request):
    stall_s = getattr(request, "param", 600.0)
    config = EngineConfig.from_flat(
        model=tiny_model_dir,
        num_kv_blocks=NUM_REQUESTS * 12,
        max_model_len=256,
        output_hwm_messages=1,
        output_backlog_messages=BACKLOG,
        output_stall_timeout_s=stall_s,
    )
    service = EngineService(EngineCore(config))
    gw = Gateway(os.path.join(ipc_dir, "outputs"))
    thread = threading.Thread(target=service.serve_zmq, args=(gw.in_addr, gw.out_addr), daemon=True)
    thread.start()
    gw.push.connect(gw.in_addr)
    try:
        yield service, gw
    finally:
        service.shutdown()
        thread.join(10)
        gw.close()
        assert not thread.is_alive()


def send_all(gw: Gateway) -> None:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
    for i in range(NUM_REQUESTS):
        gw.send(EngineRequest(f"r{i}", [5 + i, 6, 7, 8], sp))


def in_loop(service: EngineService, fn):
    return service.call_in_loop(fn, timeout_s=10.0)  # the loop must keep answering


def wait_blocked(service: EngineService, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while in_loop(service, service.stats).output_backlog_messages == 0:
        assert time.monotonic() < deadline, "the engine never had to hold outputs back"
        time.sleep(0.05)


def generated(service: EngineService) -> int:
    return in_loop(service, lambda: service.engine.scheduler.num_generation_tokens)


def wait_stopped(service: EngineService, timeout_s: float = 120.0) -> None:
    """Until the engine holds outputs back and has not stepped for five samples running.
    A first refusal can be passing: ZMQ's pipe (one message) is full until its I/O thread
    moves the message into the kernel's socket buffer, and the engine steps again once the
    backlog drains. Only when those buffers are full too does it stay stopped (on a loaded
    box the passing refusals come early: CI once saw 35 more steps after the first)."""
    deadline = time.monotonic() + timeout_s
    last, still = -1, 0
    while still < 5:
        assert time.monotonic() < deadline, "the engine never stopped stepping"
        blocked = in_loop(service, service.stats).output_backlog_messages > 0
        now = generated(service)
        still = still + 1 if blocked and now == last else 0
        last = now
        time.sleep(0.1)


def test_slow_gateway_slows_the_engine_and_loses_nothing(served):
    service, gw = served
    send_all(gw)
    wait_blocked(service)
    wait_stopped(service)
    before = generated(service)
    samples = []
    for _ in range(10):
        time.sleep(0.1)
        samples.append(in_loop(service, service.stats).output_backlog_messages)
    assert generated(service) == before  # no stepping while the gateway is behind
    assert max(samples) <= BACKLOG + 1  # bounded memory
    assert before < NUM_REQUESTS * MAX_TOKENS
    gw.read_until_finished(timeout_s=300)
    assert gw.tokens == {f"r{i}": MAX_TOKENS for i in range(NUM_REQUESTS)}
    assert {o.finish_reason for o in gw.finals.values()} == {FinishReason.LENGTH}
    assert in_loop(service, service.engine.check_integrity)


@pytest.mark.parametrize("served", [1.0], indirect=True)
def test_gateway_reading_nothing_past_the_stall_timeout_cuts_streams(served):
    service, gw = served
    send_all(gw)
    wait_blocked(service)
    deadline = time.monotonic() + 60
    while in_loop(service, service.stats).num_streams_cut < NUM_REQUESTS:
        assert time.monotonic() < deadline, "streams were not cut"
        time.sleep(0.1)
    assert in_loop(service, service.engine.check_integrity)  # nothing held: KV all free
    gw.read_until_finished(timeout_s=120)
    for out in gw.finals.values():
        assert out.finish_reason == FinishReason.ERROR and "not read" in out.error
