"""Gateway overhead: our OpenAI SSE path vs a bare uvicorn SSE endpoint.

Both servers run in their own process under the same uvicorn (h11, asyncio
loop) and stream the same events: one SSE event per token, the same chunk
shape, a usage chunk and ``[DONE]``. "gateway" is ``create_app(NullBackend)``
(parse, tokenize-free token-id prompts, detokenize, metrics, disconnect
watcher); "gateway-traced" is the same with ``--otlp-traces-endpoint``'s
tracer (every request sampled, spans exported over OTLP/HTTP to a sink in a
third process that decodes nothing); "bare" is a raw ASGI app writing
pre-encoded chunks. Both gateways log as ``tandem serve`` does (one INFO line
per finished request, written to /dev/null). The client is
``cluster.cli.bench`` (aiohttp) in this process, so the two sides never share a
GIL. Also reported: the server's CPU time per output token (from
/proc/<pid>/stat), which does not depend on the client keeping up.

``--api-server-count 1 2 4``: each server runs as N processes on one port
(SO_REUSEPORT, as ``tandem serve --api-server-count N``), bare and gateway
alike; CPU per token is summed over the N processes. The client's own CPU per
token (this process, during the gateway's runs) is printed beside it: on a
box with few cores it shares them with the servers.

The gateway processes are set up as ``tandem serve`` sets up its own: torch
barred (``cluster/gateway/torch_free.py``) and the startup heap frozen
(``cluster/gateway/heap.py``).

``--client raw``: the client is ``benchmarks/_sse_client.py`` instead of the
bench's aiohttp client: a plain epoll loop that counts the SSE events in the
bytes it reads and checks each stream's count against its usage chunk. It
spends a fraction of aiohttp's CPU per token, so on a box with few cores the
servers keep more of them; both clients send the same workload.

``--outputs-per-turn K``: the null backend hands each stream K outputs per
event-loop turn, as engines do to a gateway that runs K steps behind them
(the gateway then writes them as one; ``Backend.num_ready``); the bare
endpoint yields to the loop every K events and writes each on its own.

Run: python benchmarks/serve_gateway.py [--output-len 128] [--concurrency 64 256] [--tracing]
                                        [--api-server-count 1 2 4] [--outputs-per-turn 4]
                                        [--client aiohttp|raw]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402

INPUT_LEN = 32
OUTPUTS_PER_TURN = [1]  # --outputs-per-turn, passed on to the server processes
CLIENT = ["aiohttp"]  # --client
SEED = 0
START_TIMEOUT_S = 120.0


# ---- servers (run in a child process) -------------------------------------------------


def bare_app(model: str = "tiny", outputs_per_turn: int = 1):
    """A minimal ASGI app: /v1/models and a streaming /v1/completions."""
    head = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": model}
    chunk = (
        b"data: "
        + json.dumps(
            {
                **head,
                "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n"
    )
    models = json.dumps({"object": "list", "data": [{"id": model, "vocab_size": 262}]}).encode()
    sse_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": models})
            return
        request = json.loads(body)
        num_tokens = request["max_tokens"]
        await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
        for i in range(1, num_tokens + 1):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if i % outputs_per_turn == 0:
                await asyncio.sleep(0)  # like the NullBackend: one loop turn per K tokens
        usage = {
            "prompt_tokens": len(request["prompt"]),
            "completion_tokens": num_tokens,
            "total_tokens": len(request["prompt"]) + num_tokens,
        }
        tail = b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})

    return app


def sink_app():
    """An OTLP/HTTP receiver that accepts every export and keeps nothing."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"application/x-protobuf"), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    return app


def serve(
    kind: str,
    port: int,
    otlp_endpoint: str | None = None,
    ready_file: str | None = None,
    outputs_per_turn: int = 1,
) -> None:
    import logging

    import uvicorn

    if kind == "bare":
        app = bare_app(outputs_per_turn=outputs_per_turn)
    elif kind == "sink":
        app = sink_app()
    else:  # the gateway's process as ``tandem serve`` sets it up: no torch, heap frozen
        from tandem.cluster.gateway.torch_free import bar_torch

        bar_torch()
        from tandem.cluster.gateway.app import create_app
        from tandem.cluster.gateway.heap import freeze_startup_heap
        from tandem.cluster.gateway.null_backend import NullBackend
        from tandem.cluster.observability.logging_setup import make_handler
        from tandem.cluster.observability.tracing.settings import ObservabilityConfig, make_tracer

        root = logging.getLogger()  # as `tandem serve`: INFO, one line per request
        root.addHandler(make_handler("text", open(os.devnull, "w")))  # noqa: SIM115
        root.setLevel(logging.INFO)
        tracer = make_tracer(ObservabilityConfig(otlp_traces_endpoint=otlp_endpoint))
        kwargs = {"outputs_per_turn": outputs_per_turn} if outputs_per_turn > 1 else {}
        app = create_app(NullBackend.tiny(**kwargs), tracer=tracer)
        freeze_startup_heap()
    if ready_file is None:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        return
    # one of N processes on one port (SO_REUSEPORT), as tandem serve --api-server-count N
    from tandem.cluster.cli.gateways import reuse_port_socket

    sock = reuse_port_socket("127.0.0.1", port)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    )

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        with open(ready_file, "w") as f:
            f.write("ready")
        await task

    from tandem.cluster.cli.serve import run_event_loop

    run_event_loop(run())


# ---- driver ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_servers(kind: str, count: int) -> tuple[list[subprocess.Popen], str]:
    """``count`` processes of ``kind`` on one port (SO_REUSEPORT), all listening."""
    import tempfile

    port = free_port()
    ready_dir = tempfile.mkdtemp(prefix="serve-gateway-")
    procs = []
    for i in range(count):
        ready = os.path.join(ready_dir, str(i))
        argv = [sys.executable, os.path.abspath(__file__), "--serve", kind, "--port", str(port)]
        argv += ["--outputs-per-turn", str(OUTPUTS_PER_TURN[0])]
        procs.append(subprocess.Popen([*argv, "--ready-file", ready]))
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while len(os.listdir(ready_dir)) < count:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline_s:
            for p in procs:
                stop_server(p)
            raise RuntimeError(f"{kind} servers did not start")
        time.sleep(0.1)
    return procs, f"http://127.0.0.1:{port}"


def start_server(kind: str, otlp_endpoint: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, os.path.abspath(__file__), "--serve", kind, "--port", str(port)]
    argv += ["--outputs-per-turn", str(OUTPUTS_PER_TURN[0])]
    if otlp_endpoint:
        argv += ["--otlp-endpoint", otlp_endpoint]
    proc = subprocess.Popen(argv)
    url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline_s:
                stop_server(proc)
                raise RuntimeError(f"{kind} server did not start") from None
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measure(
    url: str, pid: int | list[int], concurrency: int, output_len: int, num_rounds: int
) -> dict:
    from tandem.cluster.cli.bench import BenchConfig, run_benchmark

    config = BenchConfig(
        url,
        num_requests=concurrency * num_rounds,
        concurrency=concurrency,
        input_len=INPUT_LEN,
        output_len=output_len,
        seed=SEED,
        request_timeout_s=300,
    )
    warmup = BenchConfig(
        url,
        num_requests=concurrency,
        concurrency=concurrency,
        input_len=INPUT_LEN,
        output_len=8,
        seed=SEED + 1,
    )
    pids = pid if isinstance(pid, list) else [pid]
    if CLIENT[0] == "raw":
        from benchmarks._sse_client import run_raw_benchmark

        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
            [card, *_] = json.loads(response.read())["data"]

        def run(bench: BenchConfig) -> dict:
            return run_raw_benchmark(bench, card["vocab_size"], card["id"])
    else:

        def run(bench: BenchConfig) -> dict:
            return asyncio.run(run_benchmark(bench))

    run(warmup)
    cpu_before_s = sum(cpu_seconds(p) for p in pids)
    client_before_s = time.process_time()
    summary = run(config)
    client_s = time.process_time() - client_before_s  # the client: this process
    cpu_s = sum(cpu_seconds(p) for p in pids) - cpu_before_s
    if summary["num_failed"]:
        raise RuntimeError(f"{summary['num_failed']} requests failed: {summary['errors']}")
    return {
        "tok_s": summary["output_token_throughput"],
        "cpu_us_per_tok": cpu_s / summary["total_output_tokens"] * 1e6,
        "client_cpu_us_per_tok": client_s / summary["total_output_tokens"] * 1e6,
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (its CPU and TTFT figures with it)."""
    return sorted(runs, key=lambda run: run["tok_s"])[len(runs) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--serve", choices=["bare", "gateway", "gateway-traced", "sink"], help=argparse.SUPPRESS
    )
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--otlp-endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    parser.add_argument(
        "--outputs-per-turn",
        type=int,
        default=1,
        help="outputs each stream gets per event-loop turn (a gateway K engine steps behind)",
    )
    parser.add_argument(
        "--api-server-count",
        type=int,
        nargs="+",
        help="run each server as N processes on one port (SO_REUSEPORT) for each N given",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also run the gateway with tracing on (100%% sampled, OTLP/HTTP to a local sink)",
    )
    parser.add_argument(
        "--client",
        choices=["aiohttp", "raw"],
        default="aiohttp",
        help="aiohttp: cluster.cli.bench, every event decoded; raw: benchmarks/_sse_client.py, "
        "events counted in the bytes (less of the client's CPU on the servers' cores)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-rounds", type=int, default=4, help="requests = rounds x concurrency")
    parser.add_argument("--repeats", type=int, default=3, help="runs per server; median kept")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.otlp_endpoint, args.ready_file, args.outputs_per_turn)
        return 0
    OUTPUTS_PER_TURN[0] = args.outputs_per_turn
    CLIENT[0] = args.client
    if args.api_server_count:
        return main_counts(args)

    # Both servers up at once; runs alternate bare/gateway so that load from
    # other processes on the machine hits both alike; the median run is kept.
    servers = {}
    sink = None
    try:
        for kind in ("bare", "gateway"):
            servers[kind] = start_server(kind)
        if args.tracing:
            sink = start_sink()
            servers["gateway-traced"] = start_server("gateway-traced", sink[1] + "/v1/traces")
        runs: dict[tuple[str, int], list[dict]] = {}
        for concurrency in args.concurrency:
            for _ in range(args.repeats):
                for kind, (proc, url) in servers.items():
                    run = measure(url, proc.pid, concurrency, args.output_len, args.num_rounds)
                    runs.setdefault((kind, concurrency), []).append(run)
    finally:
        for proc, _ in [*servers.values(), *([sink] if sink else [])]:
            stop_server(proc)
    results = {key: median_run(key_runs) for key, key_runs in runs.items()}

    print("serve_gateway: gateway (NullBackend) vs bare uvicorn SSE, output tokens/s")
    if args.tracing:
        print("gateway-traced: --otlp-traces-endpoint on, every request sampled (6 spans each)")
    print(f"machine: {machine()}")
    print(
        f"workload: input {INPUT_LEN} / output {args.output_len} tokens, 1 token per SSE event, "
        f"{args.outputs_per_turn} output(s) per stream per loop turn, "
        f"{args.num_rounds} x concurrency requests, median of {args.repeats} alternating runs, "
        f"uvicorn h11 + asyncio, client {args.client} in another process"
    )
    header = (
        "| streams | bare tok/s | gateway tok/s | ratio | bare CPU us/tok "
        "| gateway CPU us/tok | gateway TTFT p50 ms |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for concurrency in args.concurrency:
        bare = results["bare", concurrency]
        for kind in servers:
            if kind == "bare":
                continue
            gateway = results[kind, concurrency]
            print(
                f"| {concurrency:>7} | {bare['tok_s']:>10.0f} | {gateway['tok_s']:>13.0f} "
                f"| {gateway['tok_s'] / bare['tok_s']:>5.2f} | {bare['cpu_us_per_tok']:>15.1f} "
                f"| {gateway['cpu_us_per_tok']:>18.1f} | {gateway['ttft_p50_ms']:>19.1f} |"
                + (f" {kind}" if args.tracing else "")
            )
    return 0


def main_counts(args: argparse.Namespace) -> int:
    """bare and gateway, each as N processes on one port, for each N.

    Every server set is up at once (an idle uvicorn process sleeps), and each
    repeat runs them all in an order that turns by one each repeat, so that a
    change in the machine's speed over the minutes of a run falls on every set
    alike. The ratios are taken within each repeat and their median printed."""
    from tandem.cluster.cli.serve import server_stack

    runs: dict[tuple[str, int, int], list[dict]] = {}
    servers: dict[tuple[str, int], tuple[list[subprocess.Popen], str]] = {}
    try:
        for count in args.api_server_count:
            for kind in ("bare", "gateway"):
                servers[kind, count] = start_servers(kind, count)
        order = list(servers)
        for concurrency in args.concurrency:
            for repeat in range(args.repeats):
                turn = repeat % len(order)
                for kind, count in order[turn:] + order[:turn]:
                    procs, url = servers[kind, count]
                    pids = [p.pid for p in procs]
                    run = measure(url, pids, concurrency, args.output_len, args.num_rounds)
                    runs.setdefault((kind, count, concurrency), []).append(run)
    finally:
        for procs, _ in servers.values():
            for p in procs:
                stop_server(p)
    results = {key: median_run(key_runs) for key, key_runs in runs.items()}
    print("serve_gateway: N gateway processes (NullBackend) vs N bare uvicorn SSE processes")
    print(f"machine: {machine()}")
    print(
        f"workload: input {INPUT_LEN} / output {args.output_len} tokens, 1 token per SSE event, "
        f"{args.outputs_per_turn} output(s) per stream per loop turn, "
        f"{args.num_rounds} x concurrency requests, {args.repeats} repeats of every server set in "
        "a turning order (tok/s and CPU: the median run; ratios: the median of each repeat's), "
        f"N processes on one port (SO_REUSEPORT), client {args.client} in one other process; "
        "CPU summed over the N processes"
    )
    print(f"server stack: {server_stack()}")
    header = (
        "| gateways | streams | bare tok/s | gateway tok/s | ratio | gateway vs 1 gateway "
        "| bare CPU us/tok | gateway CPU us/tok | client CPU us/tok |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    first = args.api_server_count[0]
    for count in args.api_server_count:
        for concurrency in args.concurrency:
            bare, gw = results["bare", count, concurrency], results["gateway", count, concurrency]
            to_bare = paired_ratio(
                runs["gateway", count, concurrency], runs["bare", count, concurrency]
            )
            to_one = paired_ratio(
                runs["gateway", count, concurrency], runs["gateway", first, concurrency]
            )
            print(
                f"| {count:>8} | {concurrency:>7} | {bare['tok_s']:>10.0f} | {gw['tok_s']:>13.0f} "
                f"| {to_bare:>5.2f} | {to_one:>20.2f} "
                f"| {bare['cpu_us_per_tok']:>15.1f} | {gw['cpu_us_per_tok']:>18.1f} "
                f"| {gw['client_cpu_us_per_tok']:>17.1f} |"
            )
    return 0


def paired_ratio(runs: list[dict], baseline: list[dict]) -> float:
    """The median over repeats of one repeat's tok/s against the baseline's in that repeat."""
    ratios = sorted(a["tok_s"] / b["tok_s"] for a, b in zip(runs, baseline, strict=True))
    return ratios[len(ratios) // 2]


def start_sink() -> tuple[subprocess.Popen, str]:
    """The OTLP receiver: up when it answers a POST."""
    port = free_port()
    argv = [sys.executable, os.path.abspath(__file__), "--serve", "sink", "--port", str(port)]
    proc = subprocess.Popen(argv)
    url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline_s:
                stop_server(proc)
                raise RuntimeError("OTLP sink did not start") from None
            time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
