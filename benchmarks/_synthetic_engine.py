"""A stand-in engine for the gateway's real backend path, in its own process.

It speaks the engine protocol over ZMQ as a Tandem engine does (``wire/engine_protocol.py``):
it binds its input PULL (``EngineRequest`` / ``EngineAbort`` from the gateway) and
connects a PUSH to the gateway's output address, and every step sends one
``EngineOutputs`` holding one output per running request (one token each; the last one
``LENGTH`` with the request's timings), plus a heartbeat about every second. It computes
nothing: ``--step-ms`` paces the steps (0: as fast as it can); it runs until killed. Its
CPU is its own process's, so the gateway's figures stay the gateway's
(``benchmarks/gateway_token_path.py --backend engine``).

``SyntheticEngine`` starts one and stands in for its actor (``LocalMethod``: an actor method
answered in-process, as ``RayBackend`` awaits it).

Run: python benchmarks/_synthetic_engine.py --input tcp://127.0.0.1:P --output tcp://... [--step-ms 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKEN_IDS = [84, 104, 101, 32, 113, 117, 105, 99, 107]  # what the tokens are does not matter


class LocalMethod:
    """An actor method answered in this process (``.remote()`` gives an awaitable)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class SyntheticEngine:
    """This engine in its own process, and the control calls ``RayBackend`` makes of an
    engine's actor, answered here (its ``EngineHandle``'s actor)."""

    def __init__(self, output_addr: str, step_ms: float) -> None:
        import subprocess

        import msgspec

        from tandem.cluster.engines.actor import free_port
        from tandem.scheduler.engine_stats import EngineStats

        engine_id = "colocated-0"
        input_addr = f"tcp://127.0.0.1:{free_port()}"
        script = os.path.abspath(__file__)
        self.proc = subprocess.Popen(
            [sys.executable, script, "--input", input_addr, "--output", output_addr,
             "--engine-id", engine_id, "--step-ms", str(step_ms)]
        )  # fmt: skip
        info = {
            "engine_id": engine_id, "role": "colocated", "epoch": 1, "input_addr": input_addr,
            "max_model_len": 4096, "max_num_seqs": 1024, "block_size": 16,
            "prefix_caching_hash_algo": "sha256", "num_kv_blocks": 1 << 16,
        }  # fmt: skip
        stats = msgspec.msgpack.encode(EngineStats(engine_id, "colocated", 1))
        self.ready = LocalMethod(lambda: info)
        self.stats = LocalMethod(lambda: stats)
        self.set_prefill_endpoints = LocalMethod(lambda endpoints: True)
        self.leave = LocalMethod(lambda session: 0)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def serve(input_addr: str, output_addr: str, engine_id: str, epoch: int, step_s: float) -> None:
    import msgspec
    import zmq

    from tandem.wire.engine_protocol import (
        ENGINE_INPUT,
        EngineHeartbeat,
        EngineOutput,
        EngineOutputs,
        FinishReason,
        RequestTimings,
    )

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.bind(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 0)
    out.connect(output_addr)
    enc = msgspec.msgpack.Encoder()
    running: dict[str, list] = {}  # request id -> [tokens left, tokens done, received_s]
    num_steps, next_heartbeat_s = 0, 0.0
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while True:
        now_s = time.monotonic()
        if now_s >= next_heartbeat_s:
            out.send_multipart([b"H", enc.encode(EngineHeartbeat(engine_id, epoch, num_steps))])
            next_heartbeat_s = now_s + 1.0
        if dict(poller.poll(0 if running else 200)):
            while True:
                try:
                    frames = inp.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind, msg = ENGINE_INPUT.decode(frames)
                if kind == b"R":
                    running[msg.request_id] = [msg.sampling_params.max_tokens, 0, now_s]
                elif kind == b"A":
                    for rid in msg.request_ids:
                        running.pop(rid, None)
        if not running:
            continue
        outputs = []
        for rid, state in list(running.items()):
            state[0] -= 1
            token = TOKEN_IDS[state[1] % len(TOKEN_IDS)]
            state[1] += 1
            if state[0] > 0:
                outputs.append(EngineOutput(rid, [token]))
                continue
            del running[rid]
            took_s = time.monotonic() - state[2]
            timings = RequestTimings(engine_id, epoch, "colocated", finished_s=took_s)
            outputs.append(
                EngineOutput(rid, [token], finish_reason=FinishReason.LENGTH, timings=timings)
            )
        out.send_multipart([b"O", enc.encode(EngineOutputs(engine_id, outputs, time.time()))])
        num_steps += 1
        if step_s > 0:
            time.sleep(step_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="address to bind the input PULL on")
    parser.add_argument("--output", required=True, help="the gateway's output address")
    parser.add_argument("--engine-id", default="colocated-0")
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=2.0)
    args = parser.parse_args()
    serve(args.input, args.output, args.engine_id, args.epoch, args.step_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
