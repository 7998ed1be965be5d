"""Gateway edge under hostile requests: how much a concurrent stream is delayed.

A stream (NullBackend, 40 tokens at 5 ms each, so ~0.2 s alone) is timed
alone (baseline: median of ``--repeats``), then while another client sends,
one at a time: a 100k-token prompt that is tokenized and refused (400,
max_model_len 100k), a 100k-token prompt refused by the length pre-check
(max_model_len 4096), a body over the 8 MB limit (413). Reported: the
median and max extra duration of the stream over its baseline, and how long
the refused request took. The "on the loop" row tokenizes on the event loop
(what the gateway did before ``cluster/gateway/edge/``), for comparison.

Run: python benchmarks/gateway_edge.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from tandem.cluster.gateway.app import create_app, serve_in_thread  # noqa: E402
from tandem.cluster.gateway.edge.tokenizer_pool import TokenizerPool  # noqa: E402
from tandem.cluster.gateway.null_backend import NullBackend  # noqa: E402
from tandem.workers.checkpoints.tiny import build_tokenizer  # noqa: E402
from tandem.workers.text.tokenizer import encode_prompt  # noqa: E402

NUM_TOKENS = 40


def stream_s(url: str) -> float:
    start_s = time.perf_counter()
    body = {"prompt": "hi", "max_tokens": NUM_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            pass
    return time.perf_counter() - start_s


def measure(url: str, attack: dict, repeats: int) -> tuple[list[float], list[float], int]:
    delays, attack_s, status = [], [], 0
    baseline_s = statistics.median(stream_s(url) for _ in range(repeats))
    for _ in range(repeats):
        out: dict = {}

        def send(out: dict = out) -> None:
            start_s = time.perf_counter()
            out["r"] = httpx.post(f"{url}/v1/completions", timeout=60, **attack)
            out["s"] = time.perf_counter() - start_s

        thread = threading.Thread(target=send)
        thread.start()
        delays.append(stream_s(url) - baseline_s)
        thread.join(60)
        attack_s.append(out["s"])
        status = out["r"].status_code
    return delays, attack_s, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    long_prompt = {"json": {"prompt": "a" * 100_000, "max_tokens": 1}}
    big_body = {"content": json.dumps({"prompt": "x" * (9 << 20)}).encode()}
    cases = [
        ("100k-token prompt, tokenized on the pool", 100_000, long_prompt, False),
        ("100k-token prompt, tokenized on the loop", 100_000, long_prompt, True),
        ("100k-token prompt, length pre-check", 4096, long_prompt, False),
        ("9 MiB body (limit 8 MiB)", 100_000, big_body, False),
    ]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    print(f"concurrent stream: {NUM_TOKENS} tokens at 5 ms; {args.repeats} repeats")
    print("| hostile request | status | its time (median) | stream delay median | max |")
    print("|---|---|---|---|---|")
    original = TokenizerPool.encode
    for name, max_model_len, attack, on_loop in cases:
        if on_loop:

            async def inline(self, text):  # the pre-edge behaviour, for comparison
                return encode_prompt(self.tokenizer, text)

            TokenizerPool.encode = inline
        backend = NullBackend(tokenizer, max_model_len=max_model_len, output_interval_s=0.005)
        try:
            with serve_in_thread(create_app(backend)) as url:
                delays, attack_s, status = measure(url, attack, args.repeats)
        finally:
            TokenizerPool.encode = original
        print(
            f"| {name} | {status} | {statistics.median(attack_s) * 1e3:.0f} ms "
            f"| {statistics.median(delays) * 1e3:+.0f} ms | {max(delays) * 1e3:+.0f} ms |"
        )


if __name__ == "__main__":
    main()
