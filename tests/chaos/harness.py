"""Chaos harness: a real service, concurrent streaming workloads, and a
verdict per request against an undisturbed run.

A workload is ``NUM_STREAMS`` concurrent streamed completions, greedy or
seeded sampling (a seed per stream), ``logprobs=0`` so every chunk names its
tokens one by one. Each request's verdict:

    identical   completed; tokens and finish reason equal the undisturbed run's
    errored     ended with an explicit error event, after a prefix of the
                undisturbed tokens (never a wrong token)
    hung        no end within the deadline                  -> always a failure
    wrong       anything else (a silent truncation, a different token) -> failure

Migration time of a stream that was on the faulted engine: fault -> the next
token at the client.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time

import httpx

NUM_STREAMS = 16
MAX_TOKENS = 48
WORKLOADS = ("greedy", "seeded")
ENGINE = {"num_kv_blocks": 512, "max_num_seqs": 32, "max_model_len": 1024}


def serve_config(namespace: str, **kw):
    """1 prefill + 2 decode engines of the tiny model (``kw``: more serve keys)."""
    from tandem.cluster.cli.settings import serve_config

    settings = dict(
        model="tiny",
        ray_dashboard=False,
        prefill=1,
        decode=2,
        ray_namespace=namespace,
        kv_lease_s=10.0,
        engine_call_timeout_s=2.0,
        **ENGINE,
    )
    settings.update(kw)
    return serve_config(**settings)


def request_body(
    workload: str, index: int, max_tokens: int = MAX_TOKENS, prompt: str | list[int] | None = None
) -> dict:
    if prompt is None:
        prompt = f"Chaos stream {index}: a story about fault tolerance and {index * 7} engines"
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "logprobs": 0,
        "stream_options": {"include_usage": True},
    }
    if workload == "greedy":
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.9, top_p=0.95, seed=1000 + index)
    return body


@dataclasses.dataclass
class StreamResult:
    index: int
    request_id: str | None = None
    tokens: list[str] = dataclasses.field(default_factory=list)
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # monotonic
    finish_reason: str | None = None
    error: str | None = None
    completion_tokens: int | None = None
    done: bool = False  # saw [DONE]
    exception: str | None = None


class Workload:
    """``NUM_STREAMS`` streams of one workload, each in its own thread."""

    def __init__(
        self,
        base_url: str,
        workload: str,
        num_streams: int = NUM_STREAMS,
        prompts: list | None = None,
        **body_kw,
    ) -> None:
        self.url = base_url + "/v1/completions"
        self.workload = workload
        self.results = [StreamResult(i) for i in range(num_streams)]
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(
                    r,
                    request_body(
                        workload, r.index, prompt=prompts[r.index] if prompts else None, **body_kw
                    ),
                ),
                daemon=True,
            )
            for r in self.results
        ]
        for t in self._threads:
            t.start()

    def _run(self, result: StreamResult, body: dict) -> None:
        try:
            with httpx.stream("POST", self.url, json=body, timeout=180) as r:
                if r.status_code != 200:
                    result.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        result.done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = chunk["error"]["message"]
                        continue
                    result.request_id = result.request_id or chunk.get("id")
                    if chunk.get("usage"):
                        result.completion_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        tokens = (choice.get("logprobs") or {}).get("tokens") or []
                        now = time.monotonic()
                        result.tokens.extend(tokens)
                        result.token_times_s.extend([now] * len(tokens))
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
        except Exception as exc:  # noqa: BLE001 - reported as the verdict
            result.exception = repr(exc)

    def wait_tokens(self, min_tokens: int, deadline_s: float = 120.0) -> None:
        """Until every stream has ``min_tokens`` tokens (or ended)."""
        end = time.monotonic() + deadline_s
        while True:
            if all(
                len(r.tokens) >= min_tokens or not t.is_alive()
                for r, t in zip(self.results, self._threads, strict=True)
            ):
                return
            assert time.monotonic() < end, f"streams did not reach {min_tokens} tokens"
            time.sleep(0.01)

    def finish(self, deadline_s: float = 240.0) -> list[bool]:
        """Join every stream; returns per stream whether it hung (still open
        at the deadline)."""
        end = time.monotonic() + deadline_s
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return [t.is_alive() for t in self._threads]


def verdict(result: StreamResult, reference: StreamResult, hung: bool) -> str:
    if hung:
        return "hung"
    if result.exception is not None or not result.done and result.error is None:
        return "wrong"
    is_prefix = result.tokens == reference.tokens[: len(result.tokens)]
    if result.error is not None:
        return "errored" if is_prefix else "wrong"
    if (
        result.tokens == reference.tokens
        and result.finish_reason == reference.finish_reason
        and result.completion_tokens == len(result.tokens)
    ):
        return "identical"
    return "wrong"


def resume_time(token_times_s: list[float], fault_s: float) -> float | None:
    """When a stream resumed after a fault at ``fault_s``: the arrival of the
    token after the longest silence since the fault. (Tokens the dead engine
    had already sent arrive within milliseconds after the kill; the silence
    is the migration.) None if no token came after the fault."""
    times = [fault_s] + [t for t in token_times_s if t >= fault_s]
    if len(times) < 2:
        return None
    gaps = [(b - a, b) for a, b in zip(times, times[1:], strict=False)]
    return max(gaps)[1]


@dataclasses.dataclass
class Tally:
    scenario: str
    requests: int = 0
    identical: int = 0
    errored: int = 0
    hung: int = 0
    wrong: int = 0
    leaked_blocks: int = 0
    migration_s: list[float] = dataclasses.field(default_factory=list)
    details: list[str] = dataclasses.field(default_factory=list)

    def add(self, workload: str, results, references, hung, fault_s=None, moved_ids=()) -> None:
        for r, ref, h in zip(results, references, hung, strict=True):
            v = verdict(r, ref, h)
            self.requests += 1
            setattr(self, v, getattr(self, v) + 1)
            if v in ("wrong", "hung", "errored"):
                self.details.append(
                    f"{workload}[{r.index}] {v}: {len(r.tokens)}/{len(ref.tokens)} tokens, "
                    f"error={r.error!r} exc={r.exception!r} finish={r.finish_reason}"
                )
            if fault_s is not None and r.request_id in moved_ids:
                resumed_s = resume_time(r.token_times_s, fault_s)
                if resumed_s is not None:
                    self.migration_s.append(resumed_s - fault_s)

    def row(self) -> str:
        if self.migration_s:
            ms = sorted(self.migration_s)
            p50 = statistics.median(ms)
            p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
            mig = f"{p50 * 1000:.0f} / {p99 * 1000:.0f} ms (n={len(ms)})"
        else:
            mig = "-"
        return (
            f"| {self.scenario} | {self.requests} | {self.identical} | {self.errored} | "
            f"{self.hung} | {self.leaked_blocks} | {mig} |"
        )


def print_row(tally: Tally) -> None:
    print(f"\nFAULTS-ROW {tally.row()}", flush=True)
    for d in tally.details:
        print("  ", d, flush=True)
