"""Gateway limits through a real uvicorn server: body size (413), prompt length
off the event loop (400), concurrent-request cap (503 + Retry-After), request
deadline (504 / error event, request aborted on the backend).

Timing asserts are generous (seconds) except the 200 ms interference bound
of issue 11, which is measured against the same request's baseline taken in
the same test (see ``test_long_prompt_is_400_and_does_not_delay_others``).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.edge.limits import GatewayLimits
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.workers.checkpoints.tiny import build_tokenizer

DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@contextlib.contextmanager
def running(backend: NullBackend, **limits) -> Iterator[str]:
    with serve_in_thread(create_app(backend, limits=GatewayLimits(**limits))) as url:
        yield url


def wait_until(condition, timeout_s: float = DEADLINE_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "condition not met before the deadline"
        time.sleep(0.005)


def small_request(url: str, max_tokens: int = 5) -> tuple[int, float]:
    start_s = time.perf_counter()
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True},
        timeout=DEADLINE_S,
    )
    return r.status_code, time.perf_counter() - start_s


def assert_envelope(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    return error


def test_limits_validate_fields():
    with pytest.raises(ValueError, match="max_request_body_mb"):
        GatewayLimits(max_request_body_mb=0)
    with pytest.raises(ValueError, match="request_timeout_s"):
        GatewayLimits(request_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="max_num_requests"):
        GatewayLimits(max_num_requests=-1)
    with pytest.raises(ValueError, match="tokenizer_workers"):
        GatewayLimits(tokenizer_workers=0)
    assert GatewayLimits().max_request_body_bytes == 8 << 20


# ---- body limit ------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_limit_is_413_fast_and_others_complete(tokenizer, chunked):
    backend = NullBackend(tokenizer, max_model_len=100_000, output_interval_s=0.01)
    big = json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1}).encode()
    with running(backend, max_request_body_mb=1) as url:
        small: dict[str, tuple[int, float]] = {}
        thread = threading.Thread(target=lambda: small.update(r=small_request(url)))
        start_s = time.perf_counter()
        thread.start()
        if chunked:
            content = (big[i : i + 65536] for i in range(0, len(big), 65536))
            r = httpx.post(f"{url}/v1/completions", content=content, timeout=DEADLINE_S)
        else:
            r = httpx.post(f"{url}/v1/completions", content=big, timeout=DEADLINE_S)
        big_s = time.perf_counter() - start_s
        thread.join(DEADLINE_S)
        error = assert_envelope(r, 413, "request_too_large")
        assert str(1 << 20) in error["message"]
        assert big_s < 1.0, f"413 took {big_s:.2f} s"
        assert small["r"][0] == 200
        assert small["r"][1] < 1.0, f"a concurrent small request took {small['r'][1]:.2f} s"
        # the server keeps serving, and the refusal was counted
        assert small_request(url)[0] == 200
        metrics = httpx.get(f"{url}/metrics").text
        assert 'tandem:request_rejected_total{status_code="413"} 1.0' in metrics


# ---- prompt length ---------------------------------------------------------------


def _stream_duration_s(url: str, num_tokens: int) -> float:
    start_s = time.perf_counter()
    body = {"prompt": "hi", "max_tokens": num_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return time.perf_counter() - start_s


@pytest.mark.parametrize("max_model_len", [4096, 100_000], ids=["pre-check", "tokenized"])
def test_long_prompt_is_400_and_does_not_delay_others(tokenizer, max_model_len):
    """A 100k-token prompt (tiny's tokenizer: one token per ASCII byte, plus
    BOS) is refused with 400. With max_model_len 4096 the character count
    alone proves it too long (no tokenizer work); with 100k it is tokenized
    on the pool, then refused.

    Interference: a concurrent stream (NullBackend, 5 ms per token) is timed
    alone five times (baseline: the median), then while the long prompt is
    being refused; the difference must stay under 200 ms (issue 11). The
    baseline is taken in the same test on the same loaded machine, so
    machine noise cancels except for its variance."""
    backend = NullBackend(tokenizer, max_model_len=max_model_len, output_interval_s=0.005)
    prompt = "a" * 100_000
    assert len(tokenizer.encode(prompt)) == 100_001
    with running(backend) as url:
        baseline_s = statistics.median(_stream_duration_s(url, 40) for _ in range(5))
        result: dict[str, httpx.Response] = {}

        def long_prompt() -> None:
            result["r"] = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": prompt, "max_tokens": 1},
                timeout=DEADLINE_S,
            )

        delays_s = []
        for _ in range(3):
            thread = threading.Thread(target=long_prompt)
            thread.start()
            delays_s.append(_stream_duration_s(url, 40) - baseline_s)
            thread.join(DEADLINE_S)
            error = assert_envelope(result["r"], 400, "context_length_exceeded")
            assert error["param"] == "prompt"
        assert min(delays_s) < 0.2, f"delays {delays_s} over baseline {baseline_s:.3f} s"


def test_long_chat_prompt_is_400(tokenizer):
    backend = NullBackend(tokenizer, max_model_len=100_000)
    with running(backend) as url:
        for content in ("b" * 100_000, [{"type": "text", "text": "b" * 400_000}]):
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": content}]},
                timeout=DEADLINE_S,
            )
            assert assert_envelope(r, 400, "context_length_exceeded")["param"] == "messages"
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
            timeout=DEADLINE_S,
        )
        assert r.status_code == 200


# ---- concurrency cap -------------------------------------------------------------


def test_max_num_requests_is_503_with_retry_after(tokenizer):
    backend = NullBackend(tokenizer, max_model_len=100_000, output_interval_s=0.01)
    with running(backend, max_num_requests=2) as url:
        # refusals before a response (bad input, 413) give their slot back
        for _ in range(4):
            r = httpx.post(
                f"{url}/v1/completions", json={"prompt": "x", "n": 0}, timeout=DEADLINE_S
            )
            assert r.status_code == 400
        body = {"prompt": "x", "max_tokens": 50_000, "stream": True}
        with contextlib.ExitStack() as stack:
            for _ in range(2):
                r = stack.enter_context(
                    httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S)
                )
                assert r.status_code == 200
            wait_until(lambda: backend.num_running == 2)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=DEADLINE_S)
            assert_envelope(r, 503, "too_many_requests")
            assert r.headers["retry-after"] == "1"
        # both streams closed: their slots come back
        wait_until(lambda: backend.num_running == 0)
        wait_until(lambda: small_request(url)[0] == 200)


# ---- request deadline ------------------------------------------------------------


def test_request_timeout_stream_gets_error_event_and_abort(tokenizer):
    backend = NullBackend(tokenizer, max_model_len=100_000, output_interval_s=0.01)
    with running(backend, request_timeout_s=0.5) as url:
        body = {"prompt": "x", "max_tokens": 50_000, "stream": True}
        start_s = time.perf_counter()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert 0.5 <= time.perf_counter() - start_s < 5.0
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "request_timeout"
        request_id = json.loads(events[0])["id"]
        wait_until(lambda: request_id in backend.aborted_request_ids)
        wait_until(lambda: backend.num_running == 0)


def test_request_timeout_non_stream_is_504_and_abort(tokenizer):
    backend = NullBackend(tokenizer, max_model_len=100_000, output_interval_s=0.01)
    with running(backend, request_timeout_s=0.5) as url:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "x", "max_tokens": 50_000},
            timeout=DEADLINE_S,
        )
        assert_envelope(r, 504, "request_timeout")
        wait_until(lambda: len(backend.aborted_request_ids) == 1)
        wait_until(lambda: backend.num_running == 0)
        # a request within the deadline is unaffected
        assert small_request(url)[0] == 200
