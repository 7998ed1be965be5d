"""One engine, several gateways (``workers/engine/gateway_outputs.py``): each
request names its gateway, and each gateway gets exactly the outputs of its
own requests (no broadcast) while every gateway gets heartbeats. A gateway
whose process is gone (its PULL closed: the connection drops) is dropped
after ``gateway_lost_after_s`` with only its own requests aborted; the
other gateway's streams complete token-identical to a run with one
gateway, and a gateway joining later is served without disturbing them."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from tandem.cluster.engines.actor import free_port
from tandem.wire.engine_protocol import (
    EngineHeartbeat,
    EngineOutputs,
    EngineRequest,
    FinishReason,
    SamplingParams,
)
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tandem.workers.engine.service import EngineService

pytestmark = pytest.mark.slow  # an engine loop on real sockets
SP = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


class Gw:
    """One gateway's output PULL and its own PUSH to the engine's input."""

    def __init__(self, ctx: zmq.Context, session: int, in_addr: str, ipc_dir: str) -> None:
        self.session = session
        self.pull = ctx.socket(zmq.PULL)
        self.out_addr = f"ipc://{ipc_dir}/gw-{session}"
        self.pull.bind(self.out_addr)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(in_addr)
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, object] = {}
        self.heartbeats = 0
        self._dec = msgspec.msgpack.Decoder(EngineOutputs)
        self._hb = msgspec.msgpack.Decoder(EngineHeartbeat)

    def send(self, rid: str, prompt: list[int], sp: SamplingParams = SP) -> None:
        req = EngineRequest(rid, prompt, sp, gateway=self.session)
        self.push.send_multipart([b"R", msgspec.msgpack.encode(req)])

    def read(self, until, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, f"gateway {self.session}: {self.finals}"
            if not self.pull.poll(50):
                continue
            kind, payload = self.pull.recv_multipart()
            if kind == b"H":
                self._hb.decode(payload)
                self.heartbeats += 1
                continue
            for out in self._dec.decode(payload).outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finals[out.request_id] = out.finish_reason


@pytest.fixture
def engine(tiny_model_dir, ipc_dir):
    config = EngineConfig.from_flat(
        model=tiny_model_dir, num_kv_blocks=256, max_model_len=2048, gateway_lost_after_s=1.0
    )
    service = EngineService(EngineCore(config))
    in_addr = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    first = Gw(ctx, 11, in_addr, ipc_dir)
    thread = threading.Thread(
        target=service.serve_zmq,
        args=(in_addr, first.out_addr),
        kwargs={"gateway_session": first.session},
        daemon=True,
    )
    thread.start()
    # the loop serves once its first heartbeat arrives (call_in_loop before that would run
    # on this thread, before the loop made its output links)
    first.read(lambda: first.heartbeats > 0, timeout_s=60.0)
    try:
        yield service, ctx, in_addr, first
    finally:
        service.shutdown()
        thread.join(10)
        ctx.destroy(linger=0)
        assert not thread.is_alive()


def in_loop(service, fn):
    return service.call_in_loop(fn, timeout_s=10.0)


def prompts(n: int) -> list[list[int]]:
    return [[3 + i, 9, 4 + 2 * i, 7] for i in range(n)]


def test_outputs_go_to_their_own_gateway_and_a_dead_gateway_loses_only_its_streams(engine, ipc_dir):
    service, ctx, in_addr, a = engine
    b = Gw(ctx, 22, in_addr, ipc_dir)
    assert in_loop(service, lambda: service.join_gateway(b.out_addr, b.session))
    assert not in_loop(service, lambda: service.join_gateway(b.out_addr, b.session))  # idempotent
    assert service.gateway_sessions == (11, 22)

    # the single-gateway reference, then the same prompts split over two gateways
    for i, p in enumerate(prompts(6)):
        a.send(f"ref-{i}", p)
    a.read(lambda: len(a.finals) == 6)
    ref = {f"{i}": a.tokens.pop(f"ref-{i}") for i in range(6)}
    a.finals.clear()
    for i, p in enumerate(prompts(6)):
        (a if i % 2 else b).send(f"x-{i}", p)
    a.read(lambda: len(a.finals) == 3)
    b.read(lambda: len(b.finals) == 3 and b.heartbeats > 0)
    assert sorted(a.tokens) == ["x-1", "x-3", "x-5"]  # nothing of the other gateway's
    assert sorted(b.tokens) == ["x-0", "x-2", "x-4"]
    for rid, toks in {**a.tokens, **b.tokens}.items():
        assert toks == ref[rid.split("-")[1]], rid
    assert a.heartbeats > 0
    assert in_loop(service, service.check_integrity)

    # gateway b dies with long streams in flight; a's streams go on
    a.tokens.clear(), a.finals.clear(), b.tokens.clear(), b.finals.clear()
    for i in range(3):
        b.send(f"long-{i}", prompts(3)[i], LONG)
    b.read(lambda: all(len(b.tokens.get(f"long-{i}", [])) >= 2 for i in range(3)))
    for i, p in enumerate(prompts(4)):
        a.send(f"y-{i}", p)
    b.pull.close(linger=0)  # its process exited: the kernel closes the connection
    b.push.close(linger=0)
    a.read(lambda: len(a.finals) == 4)
    for i in range(4):
        assert a.tokens[f"y-{i}"] == ref[f"{i}"]
    deadline = time.monotonic() + 60
    while in_loop(service, service.stats).num_gateways != 1:
        assert time.monotonic() < deadline, "the dead gateway was never dropped"
        time.sleep(0.1)
    stats = in_loop(service, service.stats)
    assert stats.num_gateways_lost == 1 and stats.num_gateway_requests_aborted == 3
    assert stats.scheduler.num_running_reqs == stats.scheduler.num_waiting_reqs == 0
    assert stats.scheduler.kv_cache_usage == 0.0  # its blocks are free
    assert service.gateway_sessions == (11,)
    assert in_loop(service, service.check_integrity)

    # a new gateway joins and is served; a request naming no joined gateway is dropped
    c = Gw(ctx, 33, in_addr, ipc_dir)
    in_loop(service, lambda: service.join_gateway(c.out_addr, c.session))
    c.send("z-0", prompts(1)[0])
    c.read(lambda: c.finals.get("z-0") == FinishReason.LENGTH)
    assert c.tokens["z-0"] == ref["0"]
    stray = Gw(ctx, 44, in_addr, ipc_dir)
    stray.send("nobody", prompts(1)[0])
    deadline = time.monotonic() + 30
    while service.sessions.num_unroutable == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # a gateway that takes a gone one's address replaces it (its requests aborted)
    c.send("z-2", prompts(1)[0], LONG)
    c.read(lambda: len(c.tokens.get("z-2", [])) >= 1)
    assert in_loop(service, lambda: service.join_gateway(c.out_addr, 55))
    assert service.gateway_sessions == (11, 55)
    assert in_loop(service, service.check_integrity)
    in_loop(service, lambda: service.leave_gateway(55))
    in_loop(service, lambda: service.join_gateway(c.out_addr, c.session))
    # a normal exit: leave aborts the leaving gateway's requests only
    c.send("z-1", prompts(1)[0], LONG)
    c.read(lambda: len(c.tokens.get("z-1", [])) >= 1)
    assert in_loop(service, lambda: service.leave_gateway(c.session)) == 1
    assert service.gateway_sessions == (11,)
    assert in_loop(service, service.check_integrity)
