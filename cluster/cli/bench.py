"""``tandem bench``: a streaming load generator for ``/v1/completions``.

Each request sends a random token-id prompt (seeded) and streams the answer
with ``stream_options.include_usage`` so output token counts are exact.
Arrivals are either closed-loop (``--concurrency N`` requests in flight) or
open-loop Poisson (``--request-rate R`` per second, optionally capped by
``--concurrency``). Every request has a timeout, so a run always ends.

Reported, per vLLM's conventions:
  TTFT  arrival of the first text chunk - send time
  TPOT  (latency - TTFT) / (output_tokens - 1), per request
  ITL   gaps between consecutive text chunks
  E2E   send time to the end of the stream
  goodput  requests meeting every given SLO (TTFT, TPOT) per second
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.cluster.cli.trace_replay import MOONCAKE_BLOCK_TOKENS, add_trace_arguments
from tandem.cluster.planner.metrics import stats_ms

if TYPE_CHECKING:  # aiohttp is imported where a run needs it: every ``tandem`` command
    import aiohttp  # builds this module's parser, and aiohttp costs 0.3 s to import

_DEFAULT_VOCAB_SIZE = 1000  # when the server does not say; valid for any real model


@dataclass
class BenchConfig:
    url: str
    num_requests: int = 64
    concurrency: int | None = None
    request_rate: float | None = None
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    model: str | None = None
    api_key: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_timeout_s: float = 120.0
    vocab_size: int | None = None
    # replay a trace instead (cluster/cli/trace_replay.py): every row, at its time
    trace: str | None = None
    time_scale: float = 1.0
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("--range-ratio must be in [0, 1)")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be > 0")
        if not self.time_scale > 0:
            raise ValueError("--time-scale must be > 0")
        if self.trace_block_tokens < 1:
            raise ValueError("--trace-block-tokens must be >= 1")


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""
    request_id: str = ""  # the stream's ``id`` (the gateway's request id)


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, num: int) -> list[int]:
    """Uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(num)]


def build_workload(
    config: BenchConfig, vocab_size: int
) -> tuple[list[list[int]], list[int], list[float]]:
    """Prompts, output lengths and send offsets (seconds from start), all seeded."""
    rng = random.Random(config.seed)
    input_lens = sample_lengths(rng, config.input_len, config.range_ratio, config.num_requests)
    output_lens = sample_lengths(rng, config.output_len, config.range_ratio, config.num_requests)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in input_lens]
    offsets_s = [0.0] * config.num_requests
    if config.request_rate is not None:
        arrivals = random.Random(config.seed + 1)
        now_s = 0.0
        for i in range(config.num_requests):
            offsets_s[i] = now_s
            now_s += arrivals.expovariate(config.request_rate)
    return prompts, output_lens, offsets_s


async def _server_info(session: aiohttp.ClientSession, config: BenchConfig) -> tuple[str, int]:
    async with session.get(f"{config.url}/v1/models") as response:
        response.raise_for_status()
        [card, *_] = (await response.json())["data"]
    vocab_size = config.vocab_size or card.get("vocab_size") or _DEFAULT_VOCAB_SIZE
    return config.model or card["id"], int(vocab_size)


def stream_payload(model: str, prompt: list[int], max_tokens: int, ignore_eos: bool) -> dict:
    """A benchmark request's body: a greedy streamed completion whose last chunk
    carries the usage (the exact output token count)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }


async def _one_request(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    model: str,
    prompt: list[int],
    max_tokens: int,
) -> RequestResult:
    import aiohttp

    result = RequestResult(prompt_len=len(prompt))
    payload = stream_payload(model, prompt, max_tokens, config.ignore_eos)
    start_s = time.perf_counter()
    try:
        await asyncio.wait_for(
            _stream(session, f"{config.url}/v1/completions", payload, start_s, result),
            config.request_timeout_s,
        )
    except asyncio.TimeoutError:
        result.error = f"timeout after {config.request_timeout_s} s"
    except (aiohttp.ClientError, msgspec.DecodeError, KeyError, IndexError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.error:
        return result
    result.latency_s = time.perf_counter() - start_s
    result.ok = result.num_output_tokens > 0
    if not result.ok:
        result.error = "no usage in the stream"
    return result


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    start_s: float,
    result: RequestResult,
) -> None:
    """POST and read the SSE stream, filling ``result`` (``error`` on failure)."""
    last_s = start_s
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return
        buffer = b""
        async for data in response.content.iter_any():
            now_s = time.perf_counter()
            *events, buffer = (buffer + data).split(b"\n\n")
            for event in events:
                body = event.removeprefix(b"data: ")
                if body == b"[DONE]":
                    return
                chunk = msgspec.json.decode(body)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.num_output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.num_cached_tokens = details.get("cached_tokens") or 0
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if result.ttft_s == 0.0:
                        result.ttft_s = now_s - start_s
                        result.request_id = chunk.get("id", "")
                    else:
                        result.itls_s.append(now_s - last_s)
                    last_s = now_s
    result.error = "stream ended without [DONE]"


async def send_at(
    offsets_s: list[float], send: Callable[[int], Awaitable[RequestResult]]
) -> tuple[list[RequestResult], float]:
    """Open loop: start ``send(i)`` ``offsets_s[i]`` seconds from now, whether or not
    earlier requests finished; their results in order and the seconds until the last."""
    start_s = time.perf_counter()
    tasks = []
    for i, offset_s in enumerate(offsets_s):
        delay_s = start_s + offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(send(i)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start_s


async def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run the workload against ``config.url``; return the summary dict."""
    import aiohttp

    config.validate()
    concurrency = config.concurrency
    if concurrency is None and config.request_rate is None and config.trace is None:
        concurrency = 8
    limit = asyncio.Semaphore(concurrency or config.num_requests)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        model, vocab_size = await _server_info(session, config)
        if config.trace is not None:
            from tandem.cluster.cli.trace_replay import trace_workload

            prompts, output_lens, offsets_s = trace_workload(
                config.trace, vocab_size, config.seed, config.time_scale, config.trace_block_tokens
            )
        else:
            prompts, output_lens, offsets_s = build_workload(config, vocab_size)

        async def limited(i: int) -> RequestResult:
            async with limit:
                return await _one_request(session, config, model, prompts[i], output_lens[i])

        results, duration_s = await send_at(offsets_s, limited)
    summary = summarize(results, duration_s, config)
    summary["model"] = model
    summary["concurrency"] = concurrency
    return summary


def summarize(
    results: list[RequestResult], duration_s: float, config: BenchConfig
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    tpots_s = [
        (r.latency_s - r.ttft_s) / (r.num_output_tokens - 1)
        for r in done
        if r.num_output_tokens > 1
    ]
    num_output_tokens = sum(r.num_output_tokens for r in done)
    num_input_tokens = sum(r.prompt_len for r in done)
    num_cached_tokens = sum(r.num_cached_tokens for r in done)
    goodput = None
    if config.slo_ttft_ms is not None or config.slo_tpot_ms is not None:
        num_good = sum(1 for r in done if _meets_slo(r, config))
        goodput = num_good / duration_s
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "url": config.url,
        "num_requests": len(results),
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "errors": errors,
        "duration_s": duration_s,
        "request_rate": config.request_rate,
        "input_len": config.input_len,
        "output_len": config.output_len,
        "range_ratio": config.range_ratio,
        "total_input_tokens": num_input_tokens,
        "total_output_tokens": num_output_tokens,
        "total_cached_tokens": num_cached_tokens,
        "prefix_hit_rate": num_cached_tokens / num_input_tokens if num_input_tokens else 0.0,
        "trace": config.trace,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": num_output_tokens / duration_s,
        "total_token_throughput": (num_input_tokens + num_output_tokens) / duration_s,
        "goodput": goodput,
        "slo_ttft_ms": config.slo_ttft_ms,
        "slo_tpot_ms": config.slo_tpot_ms,
        "ttft_ms": stats_ms([r.ttft_s for r in done]),
        "tpot_ms": stats_ms(tpots_s),
        "itl_ms": stats_ms([itl for r in done for itl in r.itls_s]),
        "e2e_ms": stats_ms([r.latency_s for r in done]),
        "machine": f"{platform.node()} ({platform.machine()}, {_num_cpus()} CPUs)",
    }


def _meets_slo(result: RequestResult, config: BenchConfig) -> bool:
    if config.slo_ttft_ms is not None and result.ttft_s * 1000.0 > config.slo_ttft_ms:
        return False
    if config.slo_tpot_ms is not None and result.num_output_tokens > 1:
        tpot_s = (result.latency_s - result.ttft_s) / (result.num_output_tokens - 1)
        if tpot_s * 1000.0 > config.slo_tpot_ms:
            return False
    return True


def _num_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def format_table(summary: dict[str, Any]) -> str:
    mode = (
        f"rate {summary['request_rate']}/s"
        if summary["request_rate"] is not None
        else f"concurrency {summary['concurrency']}"
    )
    workload = (
        f"workload: {summary['num_requests']} requests, input {summary['input_len']} / output "
        f"{summary['output_len']} tokens (range ratio {summary['range_ratio']}), {mode}"
    )
    if summary.get("trace"):
        workload = f"workload: trace {summary['trace']}, {summary['num_requests']} requests"
    lines = [
        f"tandem bench: {summary['url']} model={summary['model']} on {summary['machine']}",
        workload,
        "",
        f"{'completed / failed':<28}{summary['num_completed']} / {summary['num_failed']}",
        f"{'duration (s)':<28}{summary['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{summary['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<28}{summary['output_token_throughput']:.1f}",
        f"{'total throughput (tok/s)':<28}{summary['total_token_throughput']:.1f}",
        f"{'prefix hit rate':<28}{summary['prefix_hit_rate']:.3f}",
    ]
    if summary["goodput"] is not None:
        slo = ", ".join(
            f"{name}<={summary[key]} ms"
            for name, key in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
            if summary[key] is not None
        )
        lines.append(f"{'goodput (req/s)':<28}{summary['goodput']:.2f}  ({slo})")
    columns = ("mean", "p50", "p90", "p99", "p99.9", "max")
    lines += ["", f"{'(ms)':<8}" + "".join(f"{k:>10}" for k in columns)]
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = summary[f"{name}_ms"]
        row = "".join(f"{stats[k]:>10.2f}" for k in columns)
        lines.append(f"{name.upper():<8}{row}")
    for error, count in summary["errors"].items():
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig(url="")
    parser.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id (default: the server's first model)")
    parser.add_argument("--api-key", help="sent as Authorization: Bearer ...")
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument(
        "--concurrency", type=int, help="max requests in flight (default 8 without --request-rate)"
    )
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    parser.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=d.output_len, help="max_tokens")
    parser.add_argument(
        "--range-ratio", type=float, default=d.range_ratio, help="lengths uniform in len*(1±r)"
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=d.ignore_eos)
    parser.add_argument("--slo-ttft-ms", type=float, help="TTFT objective for goodput")
    parser.add_argument("--slo-tpot-ms", type=float, help="TPOT objective for goodput")
    parser.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    parser.add_argument("--vocab-size", type=int, help="token ids are drawn below this")
    add_trace_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON only")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    names = BenchConfig.__dataclass_fields__
    return BenchConfig(**{k: v for k, v in vars(args).items() if k in names})


def run_from_args(args: argparse.Namespace) -> int:
    """Run, print the table (or JSON); exit status 1 if any request failed."""
    import aiohttp

    config = config_from_args(args)
    try:
        config.validate()
        summary = asyncio.run(run_benchmark(config))
    except (ValueError, aiohttp.ClientError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_table(summary), flush=True)
    return 1 if summary["num_failed"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
