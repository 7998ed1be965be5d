"""The gateway's output socket (RayBackend's reader) under hostile input,
without Ray: malformed messages from a cluster member are dropped and
counted, peers without the secret are refused and counted, and real outputs
keep flowing. The counters reach /metrics' text."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq
from prometheus_client import CollectorRegistry

from tandem.cluster.disagg.ray_backend import RayBackend
from tandem.cluster.engines.actor import free_port
from tandem.cluster.observability.metrics import EngineMetricsCollector, render
from tandem.wire.auth import PlaneAuth, generate_secret
from tandem.wire.engine_protocol import (
    GATEWAY_OUTPUT,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    SamplingParams,
)

SECRET = generate_secret()
enc = msgspec.msgpack.encode


def outputs(rid: str, token: int) -> bytes:
    return enc(EngineOutputs("decode-0", [EngineOutput(rid, new_token_ids=[token])], 0.0))


async def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_reader_drops_malformed_and_refuses_outsiders():
    async def scenario():
        addr = f"tcp://127.0.0.1:{free_port()}"
        backend = RayBackend(
            [], tokenizer=None, model_name="m", output_addr=addr, cluster_secret=SECRET
        )
        await backend.start(ready_timeout_s=10)
        ctx = zmq.Context()
        member = ctx.socket(zmq.PUSH)
        intruder = ctx.socket(zmq.PUSH)
        try:
            q: asyncio.Queue = asyncio.Queue()
            backend.plane.streams["r1"] = q
            for sock, secret in ((member, SECRET), (intruder, None)):
                sock.setsockopt(zmq.LINGER, 0)
                PlaneAuth(ctx, secret).client(sock)
                sock.connect(addr)
            intruder.send_multipart([b"O", outputs("r1", 666)])
            malformed = [
                [b"O"],
                [b"O", outputs("r1", 1), b"extra"],
                [b"O", b"\xc1 garbage"],
                [b"O", enc(EngineRequest("r1", [1], SamplingParams()))],  # wrong type
                [b"X", outputs("r1", 1)],
                [b"O", b"\x00" * (GATEWAY_OUTPUT.max_frame_bytes + 1)],
            ]
            for frames in malformed:
                member.send_multipart(frames)
            member.send_multipart([b"O", outputs("r1", 7)])
            engine_id, out = await asyncio.wait_for(q.get(), 20)
            assert (engine_id, out.new_token_ids) == ("decode-0", [7])
            await wait_for(lambda: backend.plane.auth.failures().get("gateway_output", 0) >= 1)
            member.send_multipart([b"O", outputs("r1", 8)])
            engine_id, out = await asyncio.wait_for(q.get(), 20)
            assert out.new_token_ids == [8] and q.empty()  # 666 never arrived
            snap = backend.metrics_snapshot()
            assert snap.malformed_frames == {"gateway_output": len(malformed)}
            registry = CollectorRegistry()
            registry.register(EngineMetricsCollector(backend))
            text = render(registry).decode()
            assert (
                'tandem:malformed_frames_total{engine="gateway",socket="gateway_output"} 6.0'
                in text
            )
            assert 'tandem:auth_failures_total{engine="gateway",socket="gateway_output"}' in text
            assert not any(t.done() for t in backend._tasks)  # the reader is alive
        finally:
            member.close()
            intruder.close()
            ctx.term()
            await backend.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_engine_stats_are_validated_like_frames():
    """An engine's stats payload that is not msgpack ``EngineStats`` is
    dropped (the last good stats stay) and counted as socket engine_stats."""
    from types import SimpleNamespace

    from tandem.cluster.disagg.engine import Engine
    from tandem.cluster.engines.health import EngineHealth
    from tandem.cluster.routing.router import EngineState
    from tandem.scheduler.engine_stats import EngineStats
    from tandem.wire.engine_protocol import SchedulerStats

    backend = RayBackend([], tokenizer=None, model_name="m", output_addr="tcp://127.0.0.1:1")
    try:
        state = EngineState(engine_id="decode-0", role="decode")
        e = Engine(SimpleNamespace(), state, EngineHealth(dead_after_s=30))
        good = EngineStats("decode-0", "decode", 5, scheduler=SchedulerStats(num_running_reqs=3))
        backend.members.update_stats(e, enc(good))
        assert e.stats == good and state.num_running == 3
        for bad in (b"\xc1", enc({"engine_id": "decode-0"}), {"num_running_reqs": 9}):
            backend.members.update_stats(e, bad)
        assert e.stats == good and state.num_running == 3
        assert backend.plane.malformed_frames.snapshot() == {"engine_stats": 3}
    finally:
        backend.plane.terminate()
