"""Soak: N requests at concurrency C through a real service; nothing may leak.

    python benchmarks/soak.py                        # 10,000 requests at 64, tiny model, 1P+1D
    python benchmarks/soak.py --num-requests 1000 --concurrency 32 --colocated 1

The service (``cluster.cli.serve.Service`` + the gateway under uvicorn, exactly
what ``tandem serve`` runs) lives in a child process with its own local Ray;
this process only drives HTTP load and asks the child, over a pipe, for
measurements. The workload (fixed seed): completions and chat, streaming and
not, prompts of 4..``--max-prompt-words`` words, 1..``--max-output-tokens``
output tokens, greedy or seeded sampling, and ``--disconnect-fraction`` of
the requests dropped by the client mid-way (a stream closed after its first
chunks, a plain request cancelled while it runs).

Reported: errors (any non-200, error event, missing ``[DONE]``, wrong token
count, client timeout; a dropped request is not an error), p50/p99 latency
per tenth of the run, gateway and engine RSS after 10% / 50% / 100% of the
requests, and, once the engines are idle, blocks held per engine, the
gateway's in-flight gauge and ``check_integrity()``. Targets: 0 errors, RSS
growth under 5% from the 10% sample to the end, 0 blocks held.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import gc
import json
import multiprocessing
import os
import random
import sys
import time
from typing import Any

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402

WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be "
    "has had one other their there not but have first new after also who two its been into "
    "more may time over only most state used world between during made city later under "
    "university national known while where system government river school including"
).split()
BUSY_FIELDS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_for_remote_kvs",
    "num_blocks_held_for_transfer",
)


@dataclasses.dataclass
class SoakConfig:
    num_requests: int = 10_000
    concurrency: int = 64
    disconnect_fraction: float = 0.1
    stream_fraction: float = 0.5
    max_prompt_words: int = 60  # tiny: ~5 tokens a word
    max_output_tokens: int = 32
    seed: int = 0
    model: str = "tiny"
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    num_kv_blocks: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 512
    request_timeout_s: float = 120.0  # client side: longer is an error
    idle_timeout_s: float = 60.0
    # also report the gateway's RSS after glibc's malloc_trim(0): heap the
    # allocator keeps for reuse vs memory really held (a leak survives a trim)
    malloc_trim: bool = False

    def __post_init__(self) -> None:
        if self.num_requests < 10 or self.concurrency < 1:
            raise ValueError("num_requests must be >= 10 and concurrency >= 1")
        for name in ("disconnect_fraction", "stream_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


# ---- the service, in a child process ---------------------------------------------


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _service_main(conn: Any, config: SoakConfig) -> None:
    """Child process: start the service, answer ``sample`` / ``settle`` / ``stop``. Like
    ``tandem serve``, the gateway process bars torch (``cluster/gateway/torch_free.py``)."""
    from tandem.cluster.gateway.torch_free import bar_torch

    bar_torch()
    import ray

    from tandem.cluster.cli.serve import ServiceThread
    from tandem.cluster.cli.settings import serve_config

    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    serve = serve_config(
        model=config.model,
        prefill=config.prefill,
        decode=config.decode,
        colocated=config.colocated,
        ray_dashboard=False,
        request_timeout_s=0.0,
        num_kv_blocks=config.num_kv_blocks,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
    )
    try:
        with ServiceThread(serve) as svc:
            backend = svc.service.backend
            engines = svc.run(backend.call_all("ready"))
            conn.send(("ready", svc.base_url))
            while True:
                command = conn.recv()
                if command == "stop":
                    break
                if command == "sample":
                    rss = {e: _rss_bytes(info["pid"]) for e, info in engines.items()}
                    sample = {
                        "gateway": _rss_bytes(os.getpid()),
                        "engines": rss,
                        # Python objects the collector tracks: a leak of them shows here
                        "gateway_objects": len(gc.get_objects()),
                    }
                    if config.malloc_trim:
                        ctypes.CDLL("libc.so.6").malloc_trim(0)
                        sample["gateway_trimmed"] = _rss_bytes(os.getpid())
                    conn.send(sample)
                elif command == "settle":
                    conn.send(_settle(svc, engines, config.idle_timeout_s))
    finally:
        ray.shutdown()
        conn.close()


def _settle(svc: Any, engines: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Wait (bounded) for every engine to be idle; then blocks held and integrity."""
    backend = svc.service.backend
    deadline_s = time.monotonic() + timeout_s
    while True:
        stats = svc.run(backend.call_all("stats"))
        busy = {
            e: {k: getattr(s.scheduler, k) for k in BUSY_FIELDS if getattr(s.scheduler, k)}
            for e, s in stats.items()
        }
        busy = {e: b for e, b in busy.items() if b}
        if not busy or time.monotonic() > deadline_s:
            break
        time.sleep(0.2)
    integrity = {}
    for engine_id in engines:
        try:
            integrity[engine_id] = bool(svc.run(backend.call_all("check_integrity"))[engine_id])
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            integrity[engine_id] = f"{type(exc).__name__}: {exc}"
    held = {
        e: round(s.scheduler.kv_cache_usage * engines[e]["num_kv_blocks"]) for e, s in stats.items()
    }
    return {"busy": busy, "blocks_held": held, "integrity": integrity}


# ---- the load --------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    index: int
    ok: bool
    dropped: bool
    latency_s: float
    ttft_s: float | None = None
    error: str = ""


def build_requests(config: SoakConfig) -> list[dict[str, Any]]:
    """The whole workload, from ``config.seed``."""
    rng = random.Random(config.seed)
    requests = []
    for index in range(config.num_requests):
        num_words = rng.randint(4, config.max_prompt_words)
        text = " ".join(rng.choice(WORDS) for _ in range(num_words))
        max_tokens = rng.randint(1, config.max_output_tokens)
        chat = rng.random() < 0.5
        body: dict[str, Any] = {"model": config.model, "max_tokens": max_tokens}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
        body["ignore_eos"] = True  # every request runs to max_tokens: the count is checkable
        stream = rng.random() < config.stream_fraction
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        drop = rng.random() < config.disconnect_fraction
        requests.append(
            {
                "index": index,
                "path": "/v1/chat/completions" if chat else "/v1/completions",
                "body": body,
                "drop_after_chunks": rng.randint(1, 3) if drop and stream else None,
                "drop_after_s": rng.uniform(0.005, 0.2) if drop and not stream else None,
            }
        )
    return requests


async def _one(session: aiohttp.ClientSession, url: str, spec: dict[str, Any]) -> Outcome:
    start_s = time.perf_counter()
    index = spec["index"]
    body = spec["body"]

    def outcome(ok: bool, error: str = "", ttft_s: float | None = None) -> Outcome:
        return Outcome(index, ok, False, time.perf_counter() - start_s, ttft_s, error)

    if spec["drop_after_s"] is not None:
        try:
            await asyncio.wait_for(_plain(session, url, spec), spec["drop_after_s"])
        except TimeoutError:
            return Outcome(index, True, True, time.perf_counter() - start_s)
        return Outcome(index, True, True, time.perf_counter() - start_s)  # finished first
    if body.get("stream"):
        return await _streamed(session, url, spec, start_s)
    status, text = await _plain(session, url, spec)
    if status != 200:
        return outcome(False, f"HTTP {status}: {text[:200]}")
    payload = json.loads(text)
    num_tokens = payload["usage"]["completion_tokens"]
    if num_tokens != body["max_tokens"] or payload["choices"][0]["finish_reason"] != "length":
        return outcome(False, f"{num_tokens} tokens, wanted {body['max_tokens']}")
    return outcome(True)


async def _plain(session: aiohttp.ClientSession, url: str, spec: dict[str, Any]) -> tuple:
    async with session.post(url + spec["path"], json=spec["body"]) as response:
        return response.status, await response.text()


async def _streamed(
    session: aiohttp.ClientSession, url: str, spec: dict[str, Any], start_s: float
) -> Outcome:
    index, body = spec["index"], spec["body"]
    drop_after = spec["drop_after_chunks"]
    ttft_s = None
    num_chunks = 0
    finish = usage = None
    done = False
    async with session.post(url + spec["path"], json=body) as response:
        if response.status != 200:
            text = await response.text()
            return Outcome(index, False, False, time.perf_counter() - start_s, None, text[:200])
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = f"error event: {chunk['error']}"
                return Outcome(index, False, False, time.perf_counter() - start_s, ttft_s, error)
            if ttft_s is None:
                ttft_s = time.perf_counter() - start_s
            num_chunks += 1
            for choice in chunk.get("choices", ()):
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
            if drop_after is not None and num_chunks >= drop_after:
                response.close()  # the client goes away mid-stream
                return Outcome(index, True, True, time.perf_counter() - start_s, ttft_s)
    latency_s = time.perf_counter() - start_s
    if drop_after is not None:  # ended before the drop point
        return Outcome(index, True, True, latency_s, ttft_s)
    if not done or finish != "length" or usage is None:
        error = f"stream ended: done={done} finish={finish} usage={usage}"
        return Outcome(index, False, False, latency_s, ttft_s, error)
    if usage["completion_tokens"] != body["max_tokens"]:
        error = f"{usage['completion_tokens']} tokens, wanted {body['max_tokens']}"
        return Outcome(index, False, False, latency_s, ttft_s, error)
    return Outcome(index, True, False, latency_s, ttft_s)


async def _drive(
    config: SoakConfig, url: str, sample: Any, progress: bool
) -> tuple[list[Outcome], dict[str, Any], float]:
    """Run the workload; ``sample()`` (blocking) after 10% and 50% of the requests."""
    requests = build_requests(config)
    outcomes: list[Outcome] = []
    samples: dict[str, Any] = {}
    marks = {max(1, config.num_requests // 10): "10%", config.num_requests // 2: "50%"}
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.concurrency)
    queue: asyncio.Queue = asyncio.Queue()
    for spec in requests:
        queue.put_nowait(spec)
    start_s = time.perf_counter()

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            spec = queue.get_nowait()
            try:
                result = await _one(session, url, spec)
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as exc:
                result = Outcome(spec["index"], False, False, 0.0, None, repr(exc)[:200])
            outcomes.append(result)
            mark = marks.get(len(outcomes))
            if mark:
                samples[mark] = await asyncio.to_thread(sample)
            if progress and len(outcomes) % max(1, config.num_requests // 20) == 0:
                num_errors = sum(not o.ok for o in outcomes)
                elapsed_s = time.perf_counter() - start_s
                print(
                    f"  {len(outcomes)}/{config.num_requests} done, {num_errors} errors, "
                    f"{elapsed_s:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(config.concurrency)))
    return outcomes, samples, time.perf_counter() - start_s


async def _gateway_metrics(url: str) -> tuple[float | None, dict[str, int]]:
    """The gateway's requests in flight and its finished requests per reason."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
    in_flight, finished = None, {}
    for line in text.splitlines():
        if line.startswith("tandem:num_requests_in_flight"):
            in_flight = float(line.split()[-1])
        elif line.startswith('tandem:request_success_total{finished_reason="'):
            reason = line.split('"')[1]
            finished[reason] = int(float(line.split()[-1]))
    return in_flight, finished


def run_soak(config: SoakConfig, progress: bool = False) -> dict[str, Any]:
    """Start the service in a child process, run the workload, settle, stop.
    Returns the report (see ``format_report``)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_service_main, args=(child, config), daemon=True)
    process.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the service did not start within 300 s")
        kind, url = parent.recv()
        if kind != "ready":
            raise RuntimeError(f"the service failed to start: {url}")

        def ask(command: str) -> Any:
            parent.send(command)
            if not parent.poll(config.idle_timeout_s + 60):
                raise RuntimeError(f"the service did not answer {command!r}")
            return parent.recv()

        boot = ask("sample")
        outcomes, samples, elapsed_s = asyncio.run(
            _drive(config, url, lambda: ask("sample"), progress)
        )
        settled = ask("settle")
        samples["end"] = ask("sample")
        in_flight, finished = asyncio.run(_gateway_metrics(url))
        parent.send("stop")
        process.join(120)
    finally:
        if process.is_alive():
            process.terminate()
            process.join(30)
    return {
        "config": dataclasses.asdict(config),
        "elapsed_s": elapsed_s,
        "outcomes": outcomes,
        "rss": {"boot": boot, **samples},
        "settled": settled,
        "gateway_in_flight": in_flight,
        "gateway_finished": finished,
    }


# ---- the report ------------------------------------------------------------------


def _percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    outcomes: list[Outcome] = report["outcomes"]
    errors = [o for o in outcomes if not o.ok]
    rss = report["rss"]
    base, end = rss["10%"], rss["end"]
    growth = {"gateway": end["gateway"] / base["gateway"] - 1}
    if "gateway_trimmed" in end:
        growth["gateway after malloc_trim"] = end["gateway_trimmed"] / base["gateway_trimmed"] - 1
    for engine_id, value in end["engines"].items():
        growth[engine_id] = value / base["engines"][engine_id] - 1
    return {
        "num_requests": len(outcomes),
        "num_errors": len(errors),
        "num_dropped": sum(o.dropped for o in outcomes),
        "error_samples": [o.error for o in errors[:5]],
        "rss_growth": growth,
        "blocks_held": report["settled"]["blocks_held"],
        "integrity": report["settled"]["integrity"],
        "busy_at_end": report["settled"]["busy"],
        "gateway_in_flight": report["gateway_in_flight"],
        "gateway_finished": report["gateway_finished"],
    }


def format_report(report: dict[str, Any]) -> str:
    config = report["config"]
    summary = summarize(report)
    outcomes: list[Outcome] = report["outcomes"]
    pools = (
        f"{config['colocated']} colocated"
        if config["colocated"]
        else f"{config['prefill']} prefill + {config['decode']} decode"
    )
    lines = [
        f"soak: {config['num_requests']} requests at concurrency {config['concurrency']}, "
        f"model {config['model']} ({pools}), {config['disconnect_fraction']:.0%} dropped by "
        f"the client, {config['stream_fraction']:.0%} streamed, prompts 4-"
        f"{config['max_prompt_words']} words, 1-{config['max_output_tokens']} output tokens",
        f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the end",
        f"wall {report['elapsed_s']:.0f} s, {len(outcomes) / report['elapsed_s']:.1f} requests/s",
        "",
        "| window | requests | errors | p50 latency ms | p99 latency ms | p50 TTFT ms (streams) |",
        "|---|---|---|---|---|---|",
    ]
    size = max(1, len(outcomes) // 10)
    for w in range(0, len(outcomes), size):
        part = outcomes[w : w + size]
        done = [o.latency_s * 1e3 for o in part if o.ok and not o.dropped]
        ttfts = [o.ttft_s * 1e3 for o in part if o.ttft_s is not None and not o.dropped]
        lines.append(
            f"| {w // size + 1} | {len(part)} | {sum(not o.ok for o in part)} | "
            f"{_percentile(done, 50):.0f} | {_percentile(done, 99):.0f} | "
            f"{_percentile(ttfts, 50):.0f} |"
        )
    lines += [
        "",
        "| process | RSS boot MiB | 10% | 50% | end | growth 10% -> end |",
        "|---|---|---|---|---|---|",
    ]
    rss = report["rss"]
    names = ["gateway", *rss["end"]["engines"]]
    if "gateway_trimmed" in rss["end"]:
        names.insert(1, "gateway after malloc_trim")
    for name in names:

        def at(key: str, name: str = name) -> float:
            sample = rss[key]
            if name == "gateway":
                return sample["gateway"] / 2**20
            if name == "gateway after malloc_trim":
                return sample["gateway_trimmed"] / 2**20
            return sample["engines"][name] / 2**20

        growth = summary["rss_growth"][name]
        lines.append(
            f"| {name} | {at('boot'):.0f} | {at('10%'):.0f} | {at('50%'):.0f} | "
            f"{at('end'):.0f} | {growth:+.1%} |"
        )
    lines += [
        "",
        "gateway Python objects (gc-tracked) boot / 10% / 50% / end: "
        + " / ".join(str(rss[k].get("gateway_objects")) for k in ("boot", "10%", "50%", "end")),
        f"errors: {summary['num_errors']} (dropped on purpose: {summary['num_dropped']})",
        f"blocks held at the end: {summary['blocks_held']}; integrity: {summary['integrity']}; "
        f"gateway requests in flight: {summary['gateway_in_flight']}; "
        f"finished per reason: {summary['gateway_finished']}",
    ]
    if summary["error_samples"]:
        lines.append(f"first errors: {summary['error_samples']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = SoakConfig()
    for field in dataclasses.fields(SoakConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=None)
        else:
            parser.add_argument(flag, type=type(default), default=None)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        config = SoakConfig(**overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = run_soak(config, progress=True)
    print(format_report(report))
    summary = summarize(report)
    ok = (
        summary["num_errors"] == 0
        and not any(summary["blocks_held"].values())
        and all(v is True for v in summary["integrity"].values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
