"""Cost of the internal planes' hardening on the per-token path.

One engine-shaped sender PUSHes ``EngineOutputs`` batches (one output of one
token per request, like a decode step) over loopback TCP to a PULL reader,
which decodes every batch the way the gateway does. Three configurations:

  plain   : recv_multipart() + msgspec decode (the reader before hardening)
  checked : recv_multipart(copy=False) + FrameSpec.decode (frame count, size
            cap, typed decode; the sender's address is readable on a drop)
  curve   : checked, with CURVE on both sockets (tandem serve's default)

Reports microseconds per batch (sender and reader in one process, so the
figure includes both ends) and the overhead against ``plain``; then the
reader's decode alone (no sockets, best of 5 timeit runs, so little
affected by other load on the machine). Run:
python benchmarks/wire_overhead.py [--batches 20000] [--batch-size 1 8 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402
import zmq  # noqa: E402

from benchmarks._machine import machine  # noqa: E402
from tandem.wire.auth import PlaneAuth, generate_secret  # noqa: E402
from tandem.wire.engine_protocol import (  # noqa: E402
    GATEWAY_OUTPUT,
    EngineOutput,
    EngineOutputs,
)


def run(mode: str, num_batches: int, batch_size: int) -> float:
    """Microseconds per batch, send + receive + decode."""
    ctx = zmq.Context()
    secret = generate_secret() if mode == "curve" else None
    server_auth, client_auth = PlaneAuth(ctx, secret), PlaneAuth(ctx, secret)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.LINGER, 0)
    server_auth.server(pull, "gateway_output")
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    client_auth.client(push)
    push.connect(f"tcp://127.0.0.1:{port}")
    payload = _batch(batch_size)
    push.send_multipart([b"O", payload])  # connect + handshake outside the timing
    pull.recv_multipart()
    decoder = msgspec.msgpack.Decoder(EngineOutputs)

    def send():
        for _ in range(num_batches):
            push.send_multipart([b"O", payload])

    sender = threading.Thread(target=send)
    start = time.perf_counter()
    sender.start()
    for _ in range(num_batches):
        if mode == "plain":
            kind, raw = pull.recv_multipart()
            batch = decoder.decode(raw)
        else:
            kind, batch = GATEWAY_OUTPUT.decode(pull.recv_multipart(copy=False))
        assert len(batch.outputs) == batch_size
    elapsed = time.perf_counter() - start
    sender.join()
    pull.close()
    push.close()
    server_auth.close()
    ctx.term()
    return elapsed / num_batches * 1e6


def _batch(size: int) -> bytes:
    outputs = [EngineOutput(f"req-{i}", new_token_ids=[1234]) for i in range(size)]
    return msgspec.msgpack.encode(EngineOutputs("decode-0", outputs, 0.0))


def decode_only_us(size: int, number: int = 100_000) -> tuple[float, float]:
    """(plain decode, FrameSpec.decode of received zmq.Frames), µs per batch."""
    payload = _batch(size)
    decoder = msgspec.msgpack.Decoder(EngineOutputs)
    frames = [zmq.Frame(b"O"), zmq.Frame(payload)]
    plain = min(timeit.repeat(lambda: decoder.decode(payload), number=number, repeat=5))
    checked = min(timeit.repeat(lambda: GATEWAY_OUTPUT.decode(frames), number=number, repeat=5))
    return plain / number * 1e6, checked / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{args.batches} EngineOutputs batches over loopback TCP, median of {args.repeat} runs")
    print("| outputs/batch | bytes | plain µs | checked µs | curve µs | checked +% | curve +% |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for size in args.batch_size:
        med = {
            mode: statistics.median(run(mode, args.batches, size) for _ in range(args.repeat))
            for mode in ("plain", "checked", "curve")
        }
        nbytes = len(_batch(size))
        print(
            f"| {size} | {nbytes} | {med['plain']:.1f} | {med['checked']:.1f} | {med['curve']:.1f} "
            f"| {100 * (med['checked'] / med['plain'] - 1):+.0f}% "
            f"| {100 * (med['curve'] / med['plain'] - 1):+.0f}% |"
        )
    print("\nreader decode alone (best of 5):")
    print("| outputs/batch | plain decode µs | FrameSpec.decode µs |")
    print("| --- | --- | --- |")
    for size in args.batch_size:
        plain, checked = decode_only_us(size)
        print(f"| {size} | {plain:.2f} | {checked:.2f} |")


if __name__ == "__main__":
    main()
