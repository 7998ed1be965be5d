"""The gateway's own CPU per streamed token, without HTTP or sockets.

Drives the gateway's ASGI app (``create_app(NullBackend)``) in-process: 64
(``--streams``) concurrent streaming completions of 128 tokens each, one token per SSE
event, with a ``send`` that only counts the body events (no h11, no socket
write). What is left is our per-token Python (``RequestRun.take``, the response's stream loop,
the detokenizer, the SSE delta, the metrics) plus the null backend and the
event loop. ``benchmarks/serve_gateway.py`` measures the whole server.

The process is set up as ``tandem serve``'s gateway (torch barred, startup heap
frozen, one INFO line per finished request, written to /dev/null). The same
harness also drives ``serve_gateway.py``'s bare ASGI app (pre-encoded chunks, one
loop turn per token), runs alternating: "gateway - bare" is what our code adds
per token over an endpoint that does nothing but stream, HTTP and socket aside.

``--backend engine``: the gateway over the production backend (``RayBackend``: the ZMQ
data plane, one queue per stream, the orchestrator's try and migration ledger) and one
colocated engine played by ``benchmarks/_synthetic_engine.py`` in its own process (one
``EngineOutputs`` per step with a token for each running request, paced by
``--engine-step-ms``; its control calls are answered in this process, no Ray). The
figure is this process's CPU per token (its ZMQ I/O thread included), the engine's
not: what the null backend's figure misses of a real gateway's per-token path.

Run: python benchmarks/gateway_token_path.py [--repeats 6] [--profile] [--streams 64] [--tokens 128]
     [--backend null|engine] [--engine-step-ms 2] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402

NUM_STREAMS, NUM_TOKENS, ROUNDS = 64, 128, 4


def scope(body: bytes) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip


async def stream(app, body: bytes, counts: list[int]) -> None:
    sent = False
    never = asyncio.Event()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the client never disconnects
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            counts[0] += 1

    await app(scope(body), receive, send)


def request_body(num_tokens: int = NUM_TOKENS) -> bytes:
    """The streamed completion every stream sends: ``num_tokens`` tokens, usage at the end."""
    return json.dumps(
        {"model": "tiny", "prompt": list(range(5, 37)), "max_tokens": num_tokens,
         "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    ).encode()  # fmt: skip


async def run_once(
    app,
    body: bytes,
    rounds: int,
    num_streams: int = NUM_STREAMS,
    num_tokens: int = NUM_TOKENS,
    counts: list[int] | None = None,
) -> float:
    """CPU microseconds per token over ``rounds`` x ``num_streams`` streams of
    ``num_tokens`` tokens (the request ``body`` must ask for as many). ``counts[0]``, when
    given, grows by the body events the app sent."""
    counts = [0] if counts is None else counts
    start = time.process_time()
    for _ in range(rounds):
        await asyncio.gather(*(stream(app, body, counts) for _ in range(num_streams)))
    return (time.process_time() - start) / (rounds * num_streams * num_tokens) * 1e6


async def engine_backend(tokenizer, step_ms: float):
    """A started ``RayBackend`` over one synthetic engine, and the engine."""
    from benchmarks._synthetic_engine import SyntheticEngine
    from tandem.cluster.disagg.ray_backend import RayBackend
    from tandem.cluster.engines.actor import free_port
    from tandem.cluster.engines.pools import EngineHandle
    from tandem.cluster.routing.policy import RoutingConfig

    output_addr = f"tcp://127.0.0.1:{free_port()}"
    engine = SyntheticEngine(output_addr, step_ms)
    backend = RayBackend(
        [EngineHandle("colocated-0", "colocated", engine)],
        tokenizer=tokenizer,
        model_name="tiny",
        output_addr=output_addr,
        engine_dead_after_s=120.0,
        routing=RoutingConfig(router="least-load"),
    )
    try:
        await backend.start(ready_timeout_s=60)
    except BaseException:
        engine.stop()
        raise
    return backend, engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--profile", action="store_true", help="cProfile one run, top --top")
    parser.add_argument("--sort", default="tottime", help="--profile's order (pstats' keys)")
    parser.add_argument("--top", type=int, default=25, help="--profile's rows")
    parser.add_argument(
        "--streams", type=int, default=NUM_STREAMS, help="concurrent streams (rounds scale down)"
    )
    parser.add_argument(
        "--tokens", type=int, default=NUM_TOKENS, help="output tokens per request (rounds scale up)"
    )
    parser.add_argument(
        "--backend", choices=["null", "engine"], default="null",
        help="the gateway's backend: the null one, or RayBackend over a synthetic engine",
    )  # fmt: skip
    parser.add_argument(
        "--engine-step-ms", type=float, default=2.0, help="--backend engine: the step's pacing"
    )
    parser.add_argument(
        "--rounds", type=int, default=0, help="rounds per run (default: the same tokens per run)"
    )
    args = parser.parse_args()
    return asyncio.run(amain(args))


async def amain(args: argparse.Namespace) -> int:
    # the same tokens per run
    rounds = args.rounds or max(
        1, ROUNDS * NUM_STREAMS * NUM_TOKENS // (args.streams * args.tokens)
    )
    from tandem.cluster.gateway.torch_free import bar_torch

    bar_torch()  # the gateway's process as ``tandem serve`` sets it up: no torch, heap frozen
    import logging

    from tandem.cluster.gateway.app import create_app
    from tandem.cluster.gateway.heap import freeze_startup_heap
    from tandem.cluster.gateway.null_backend import NullBackend
    from tandem.cluster.observability.logging_setup import make_handler

    root = logging.getLogger()  # as `tandem serve`: INFO, one line per request
    root.addHandler(make_handler("text", open(os.devnull, "w")))  # noqa: SIM115
    root.setLevel(logging.INFO)
    backend = NullBackend.tiny()
    engine = None
    if args.backend == "engine":
        backend, engine = await engine_backend(backend.tokenizer, args.engine_step_ms)
    try:
        app = create_app(backend)
        freeze_startup_heap()
        return await measure(app, args, rounds)
    finally:
        if engine is not None:
            await backend.close()
            engine.stop()


async def measure(app, args: argparse.Namespace, rounds: int) -> int:
    from benchmarks.serve_gateway import bare_app

    bare = bare_app()
    body = request_body(args.tokens)
    await run_once(app, body, 1)  # warm-up: caches, imports
    await run_once(bare, body, 1)
    if args.profile:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            await run_once(app, body, rounds, args.streams, args.tokens)
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
        return 0
    runs: dict[str, list[float]] = {"bare": [], "gateway": []}
    for _ in range(args.repeats):
        runs["bare"].append(await run_once(bare, body, rounds, args.streams, args.tokens))
        runs["gateway"].append(await run_once(app, body, rounds, args.streams, args.tokens))
    print("gateway_token_path: CPU per token in-process (ASGI, no HTTP, no socket)")
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.1f}")
    backend = (
        "null backend"
        if args.backend == "null"
        else f"RayBackend over a synthetic engine ({args.engine_step_ms:g} ms steps)"
    )
    print(
        f"workload: {args.streams} streams x {args.tokens} tokens x {rounds} rounds, "
        f"{backend}, {args.repeats} alternating runs"
    )
    print("| app | median CPU us/token | min | max |")
    print("|---|---:|---:|---:|")
    for name, values in runs.items():
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |"
        )
    extra = statistics.median(runs["gateway"]) - statistics.median(runs["bare"])
    extra_min = min(runs["gateway"]) - min(runs["bare"])
    print(f"| gateway - bare | {extra:.2f} | {extra_min:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
