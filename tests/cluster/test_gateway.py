"""Gateway + NullBackend through a real uvicorn server and the official openai client.

Oracles: the tokenizer (``decode`` of the NullBackend's known token ids,
``encode_prompt`` / ``apply_chat_template`` for prompt sizes).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.wire.engine_protocol import EngineOutput
from tandem.workers.checkpoints.tiny import build_tokenizer
from tandem.workers.text.tokenizer import apply_chat_template, encode_prompt

MAX_MODEL_LEN = 256
DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    # One client for the module: creating one costs ~10-100 ms (TLS context).
    with httpx.Client(verify=False) as client:
        yield client


def make_client(url: str, http: httpx.Client, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, http_client=http)


@contextlib.contextmanager
def running(backend: NullBackend, api_key: str | None = None) -> Iterator[str]:
    with serve_in_thread(create_app(backend, api_key=api_key)) as url:
        yield url


@pytest.fixture(scope="module")
def server(tokenizer):
    backend = NullBackend(tokenizer, max_model_len=MAX_MODEL_LEN)
    with running(backend) as url:
        yield backend, url


@pytest.fixture
def backend(server) -> NullBackend:
    return server[0]


@pytest.fixture
def url(server) -> str:
    return server[1]


@pytest.fixture
def client(url, http) -> openai.OpenAI:
    return make_client(url, http)


def wait_until(condition: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "condition not met before the deadline"
        time.sleep(0.005)


def expected_text(backend: NullBackend, num_tokens: int) -> str:
    return backend.tokenizer.decode(backend.token_ids_for(num_tokens))


# ---- completions -------------------------------------------------------------------


def test_completion(client, backend, tokenizer):
    response = client.completions.create(model="tiny", prompt="hello", max_tokens=12)
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    assert response.model == "tiny"
    [choice] = response.choices
    assert choice.text == expected_text(backend, 12) == "The quick br"
    assert choice.finish_reason == "length"
    num_prompt_tokens = len(encode_prompt(tokenizer, "hello"))
    assert response.usage.prompt_tokens == num_prompt_tokens
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == num_prompt_tokens + 12


def test_completion_default_max_tokens_is_16(client, backend):
    response = client.completions.create(model="tiny", prompt="hello")
    assert response.choices[0].text == expected_text(backend, 16)
    assert response.usage.completion_tokens == 16


def test_completion_stream_with_usage(client, backend, tokenizer):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hello",
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in token_chunks) == expected_text(backend, 9)
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 8 + ["length"]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == len(encode_prompt(tokenizer, "hello"))
    assert usage_chunk.usage.completion_tokens == 9
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_raw_sse_framing(url, http):
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b""  # every event ends with a blank line
    assert events[-2] == b"data: [DONE]"
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert [p["choices"][0]["text"] for p in payloads] == ["T", "h", "e"]
    assert all("usage" not in p for p in payloads)


def test_prompt_as_token_ids(client, backend):
    for prompt in ([5, 6, 7], [[5, 6, 7]], ["abc"]):
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
        assert response.choices[0].text == expected_text(backend, 4)
        assert response.usage.prompt_tokens == (4 if prompt == ["abc"] else 3)  # <s> + 3 bytes


def test_multi_token_outputs(tokenizer, http):
    backend = NullBackend(tokenizer, num_tokens_per_output=4)
    with running(backend) as url:
        client = make_client(url, http)
        chunks = list(
            client.completions.create(prompt="x", max_tokens=10, stream=True, model="tiny")
        )
        assert [c.choices[0].text for c in chunks] == ["The ", "quic", "k "]
        response = client.completions.create(prompt="x", max_tokens=10, stop=["ic"], model="tiny")
        assert response.choices[0].text == "The qu"
        assert response.usage.completion_tokens == 8  # the token completing "ic" is counted


# ---- chat ------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_chat(client, backend, tokenizer):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(backend, 10)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(apply_chat_template(tokenizer, MESSAGES))
    assert response.usage.completion_tokens == 10


def test_chat_default_max_tokens_fills_context(client, tokenizer):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES)
    num_prompt_tokens = len(apply_chat_template(tokenizer, MESSAGES))
    assert response.usage.completion_tokens == MAX_MODEL_LEN - num_prompt_tokens
    assert response.choices[0].finish_reason == "length"


def test_chat_max_completion_tokens(client):
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=3
    )
    assert response.choices[0].message.content == "The"


def test_chat_stream_with_usage(client, backend, tokenizer):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    first, *token_chunks, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content for c in token_chunks) == expected_text(backend, 7)
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 7
    assert usage_chunk.usage.prompt_tokens == len(apply_chat_template(tokenizer, MESSAGES))


# ---- stopping --------------------------------------------------------------------


def test_stop_string_completion(client, backend, tokenizer):
    response = client.completions.create(
        model="tiny", prompt="x", max_tokens=40, stop=["fox", "zzz"]
    )
    assert response.choices[0].text == "The quick brown "
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == len("The quick brown fox")  # one byte per token
    wait_until(lambda: response.id in backend.aborted_request_ids)


def test_stop_string_stream_and_included(client):
    chunks = list(
        client.completions.create(
            model="tiny", prompt="x", max_tokens=40, stop="brown", stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == "The quick "
    assert chunks[-1].choices[0].finish_reason == "stop"
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=40,
        stop=["brown"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert response.choices[0].message.content == "The quick brown"


def test_stop_token_id(client, tokenizer):
    [q_id] = tokenizer.encode("q", add_special_tokens=False)
    response = client.completions.create(
        model="tiny", prompt="x", max_tokens=40, extra_body={"stop_token_ids": [q_id]}
    )
    assert response.choices[0].text == "The "  # the stop token is counted, not shown
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == 5


def test_eos_respects_ignore_eos_and_min_tokens(tokenizer, http):
    eos = tokenizer.eos_token_id
    cycle = tokenizer.encode("ab", add_special_tokens=False) + [eos]
    backend = NullBackend(tokenizer, output_token_ids=cycle)
    with running(backend) as url:
        client = make_client(url, http)
        response = client.completions.create(model="tiny", prompt="x", max_tokens=8)
        assert (response.choices[0].text, response.choices[0].finish_reason) == ("ab", "stop")
        assert response.usage.completion_tokens == 3
        response = client.completions.create(
            model="tiny", prompt="x", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert (response.choices[0].text, response.choices[0].finish_reason) == ("ababab", "length")
        response = client.completions.create(
            model="tiny", prompt="x", max_tokens=8, extra_body={"min_tokens": 4}
        )
        assert (response.choices[0].text, response.usage.completion_tokens) == ("abab", 6)


# ---- logprobs --------------------------------------------------------------------


def test_completion_logprobs_shape(client, tokenizer):
    response = client.completions.create(model="tiny", prompt="x", max_tokens=5, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == ["T", "h", "e", " ", "q"]
    assert logprobs.token_logprobs == [-0.5] * 5
    assert logprobs.top_logprobs[0] == {"T": -0.5, "U": -1.5}
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [0, 1, 2, 3, 4]
    chunks = list(
        client.completions.create(model="tiny", prompt="x", max_tokens=3, logprobs=0, stream=True)
    )
    assert [c.choices[0].logprobs.tokens for c in chunks] == [["T"], ["h"], ["e"]]
    assert [c.choices[0].logprobs.text_offset for c in chunks] == [[0], [1], [2]]


def test_chat_logprobs_shape(client):
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert [c.token for c in content] == ["T", "h", "e", " "]
    assert content[0].bytes == [ord("T")]
    assert [t.token for t in content[0].top_logprobs] == ["T", "U", "V"]
    assert [t.logprob for t in content[0].top_logprobs] == [-0.5, -1.5, -2.5]
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert response.choices[0].logprobs is None


# ---- bad input -------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [
    (C, b"{not json", None),
    (C, b"[1, 2]", None),
    (C, {"max_tokens": 5}, "prompt"),
    (C, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 5.5}, "max_tokens"),
    (C, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "x", "stream": "yes"}, "stream"),
    (C, {"prompt": 42}, "prompt"),
    (C, {"prompt": ["a", "b"]}, "prompt"),
    (C, {"prompt": [[1], [2]]}, "prompt"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": [1, 99999]}, "prompt"),
    (C, {"prompt": [-1]}, "prompt"),
    (C, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    (C, {"prompt": [1] * MAX_MODEL_LEN}, "prompt"),
    (C, {"prompt": "x", "temperature": -0.1}, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "x", "top_k": -2}, "top_k"),
    (C, {"prompt": "x", "n": 0}, "n"),
    (C, {"prompt": "x", "n": 129}, "n"),
    (C, {"prompt": "x", "best_of": 2}, "best_of"),
    (C, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "x", "stop": [""]}, "stop"),
    (C, {"prompt": "x", "stop": [1]}, "stop[0]"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    (C, {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    (C, {"prompt": "x", "presence_penalty": -2.01}, "presence_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "x", "repetition_penalty": -1.0}, "repetition_penalty"),
    (C, {"prompt": "x", "min_p": 1.5}, "min_p"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
    (C, {"prompt": "x", "bad_words": ["  "]}, "bad_words"),
    (C, {"prompt": "x", "bad_words": "x"}, "bad_words"),
    (CHAT, {"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"5": -101}}, "logit_bias"),
    (C, {"prompt": "x", "seed": 2**64}, "seed"),
    (C, b'{"prompt": "x", "temperature": 1e400}', "temperature"),
    (C, {"prompt": "x", "n": 2, "logit_bias": {"1": "x"}}, "logit_bias[...]"),
    (C, b"", None),
    (C, b"\xff\xfe", None),
    (C, {"prompt": "x", "stop_token_ids": [100000]}, "stop_token_ids"),
    (C, {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    (C, {"prompt": "x", "priority": 2**63}, "priority"),
    (C, {"prompt": "x", "priority": 1.5}, "priority"),
    (C, {"prompt": "x", "cache_salt": 7}, "cache_salt"),
    (CHAT, {"messages": MESSAGES, "cache_salt": ["a"]}, "cache_salt"),
    (CHAT, {"max_tokens": 5}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": MESSAGES, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": 2}, "logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "n": -1}, "n"),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]}, "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_request_is_400_with_envelope(url, path, body, param, http):
    if isinstance(body, bytes):
        response = http.post(f"{url}{path}", content=body)
    else:
        response = http.post(f"{url}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param


def test_still_serving_after_bad_requests(client, url, backend, http):
    for path, body, _ in BAD_REQUESTS:
        http.post(f"{url}{path}", json=body if isinstance(body, dict) else None)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert excinfo.value.status_code == 400
    assert (
        client.completions.create(model="tiny", prompt="x", max_tokens=3).choices[0].text == "The"
    )
    # the backend's generator is closed just after the body went out
    wait_until(lambda: backend.num_running == 0)


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
_FIELDS = ["model", "max_tokens", "stop", "stream", "stream_options", "temperature", "top_p",
           "seed", "n", "logprobs", "top_logprobs", "echo", "top_k", "min_tokens", "ignore_eos",
           "max_completion_tokens", "stop_token_ids", "logit_bias", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "min_p", "bad_words"]  # fmt: skip
_PROMPTS = st.text(max_size=20) | st.lists(st.integers(-3, 300), max_size=6) | _JSON
_MESSAGES = (
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 3]), "content": _JSON}),
        max_size=2,
    )
    | _JSON
)


@settings(max_examples=60, deadline=None)
@given(
    fields=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=5),
    prompt=_PROMPTS,
    messages=_MESSAGES,
    chat=st.booleans(),
)
def test_never_500_for_bad_input(server, http, fields, prompt, messages, chat):
    _, url = server
    if chat:
        response = http.post(f"{url}{CHAT}", json={"messages": messages, **fields})
    else:
        response = http.post(f"{url}{C}", json={"prompt": prompt, **fields})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_explicit_nulls_mean_defaults(http, url, backend):
    nulls = dict.fromkeys(["n", "stream", "echo", "max_tokens", "temperature", "stop", "seed"])
    response = http.post(f"{url}/v1/completions", json={"prompt": "x", **nulls})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == expected_text(backend, 16)
    nulls = dict.fromkeys(["logprobs", "top_logprobs", "add_generation_prompt", "stream_options"])
    response = http.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, **nulls})
    assert response.status_code == 200
    assert response.json()["choices"][0]["logprobs"] is None


def test_unknown_route_and_method(url, http):
    response = http.get(f"{url}/v1/nope")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    assert http.get(f"{url}/v1/completions").status_code == 405


def test_models(client):
    [model] = client.models.list().data
    assert model.id == "tiny"
    assert model.max_model_len == MAX_MODEL_LEN


# ---- auth, health, unavailable, errors -------------------------------------------


def test_api_key(tokenizer, http):
    with running(NullBackend(tokenizer), api_key="sekret") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            response = http.post(
                f"{url}/v1/completions", json={"prompt": "x"}, headers=headers, timeout=10
            )
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert http.get(f"{url}/v1/models").status_code == 401
        assert http.get(f"{url}/health").status_code == 200
        client = make_client(url, http, api_key="sekret")
        assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage
        with pytest.raises(openai.AuthenticationError):
            make_client(url, http, api_key="no").models.list()


def test_health_and_503_until_ready(tokenizer, http):
    backend = NullBackend(tokenizer)
    backend.set_ready(False, "loading weights")
    with running(backend) as url:
        response = http.get(f"{url}/health")
        assert response.status_code == 503
        assert response.json()["reason"] == "loading weights"
        for stream in (False, True):
            response = http.post(
                f"{url}/v1/completions", json={"prompt": "x", "stream": stream}, timeout=10
            )
            assert response.status_code == 503
            assert "loading weights" in response.json()["error"]["message"]
        backend.set_ready(True)
        assert http.get(f"{url}/health").json() == {"status": "ok"}
        response = http.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 200
        metrics = http.get(f"{url}/metrics").text
        assert 'tandem:request_rejected_total{status_code="503"} 2.0' in metrics


def test_overload_is_503(tokenizer, http):
    backend = NullBackend(tokenizer, max_num_running=1, output_interval_s=0.02)
    with running(backend) as url:
        body = {"prompt": "x", "max_tokens": 200, "stream": True}
        with http.stream("POST", f"{url}/v1/completions", json=body) as first:
            assert first.status_code == 200
            response = http.post(f"{url}/v1/completions", json={"prompt": "x"})
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "service_unavailable"


def test_backend_error_mid_stream_and_not(tokenizer, http):
    backend = NullBackend(tokenizer)
    backend.fail_after_num_tokens = 3
    with running(backend) as url:
        body = {"prompt": "x", "max_tokens": 10, "stream": True}
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            events = [e for e in response.iter_lines() if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["message"] == "injected"
        texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-2]]
        assert texts == ["T", "h", "e"]
        response = http.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "injected"
        metrics = http.get(f"{url}/metrics").text
        assert 'tandem:request_success_total{finished_reason="error"} 2.0' in metrics
    assert list(backend.aborted_request_ids) == []  # errors are final: nothing to abort


class _EndsEarly(NullBackend):
    """Its iterator ends after ``num_outputs`` token outputs, without a final one."""

    num_outputs = 0

    async def generate(self, request):
        for _ in range(self.num_outputs):
            yield EngineOutput(request.request_id, [self.output_token_ids[0]])


@pytest.mark.parametrize("num_outputs", [0, 2])
def test_backend_ending_without_a_final_output(tokenizer, http, num_outputs):
    """A backend iterator that ends before a final output (none at all, or tokens only)
    answers an engine error, streamed (its text so far, the error event, [DONE]) and not
    (500); the request is counted as an error and nothing is left in flight."""
    backend = _EndsEarly(tokenizer)
    backend.num_outputs = num_outputs
    message = "The backend ended the request without a final output."
    with running(backend) as url:
        body = {"prompt": "x", "max_tokens": 10, "stream": True}
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = [e for e in response.iter_lines() if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["message"] == message
        texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-2]]
        assert texts == ["T"] * num_outputs
        response = http.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 500
        assert response.json()["error"]["message"] == message
        metrics = http.get(f"{url}/metrics").text
        assert 'tandem:request_success_total{finished_reason="error"} 2.0' in metrics
        assert "tandem:num_requests_in_flight 0.0" in metrics
    assert list(backend.aborted_request_ids) == []


class _FailsToStart(NullBackend):
    def generate(self, request):
        raise RuntimeError("the backend broke")


def test_backend_that_raises_at_dispatch_answers_500_in_the_envelope(tokenizer, http):
    """An unexpected exception opening the request (not ``BackendUnavailable``) is a 500 in
    the OpenAI envelope, streamed or not, and the gateway keeps serving."""
    backend = _FailsToStart(tokenizer)
    with running(backend) as url:
        for stream in (True, False):
            body = {"prompt": "x", "max_tokens": 4, "stream": stream}
            response = http.post(f"{url}/v1/completions", json=body)
            assert response.status_code == 500
            assert response.json()["error"]["type"] == "server_error"
        assert http.get(f"{url}/health").status_code == 200
        metrics = http.get(f"{url}/metrics").text
        assert "tandem:num_requests_in_flight 0.0" in metrics


class _FailsToPrepare(NullBackend):
    """``max_model_len`` raises once ``broken``: an unexpected error while the route
    prepares the request, before any response."""

    broken = False

    @property
    def max_model_len(self) -> int:
        if self.broken:
            raise RuntimeError("preparing broke")
        return self._max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        self._max_model_len = value


def test_unexpected_error_preparing_answers_500_in_the_envelope(tokenizer, http):
    """The generation routes run ahead of Starlette's middleware (``_GatewayApp``) with the
    same handlers: an unexpected exception in the route is a 500 in the OpenAI envelope,
    its slot is released and the gateway keeps serving."""
    backend = _FailsToPrepare(tokenizer)
    with running(backend) as url:
        backend.broken = True
        for path, body in (
            ("completions", {"prompt": "x", "max_tokens": 4, "stream": True}),
            ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            # a connection of its own: the error goes on to the server (as Starlette's
            # ServerErrorMiddleware does), which closes the connection after the 500
            response = httpx.post(f"{url}/v1/{path}", json=body, timeout=DEADLINE_S)
            assert response.status_code == 500
            assert response.json()["error"]["type"] == "server_error"
        backend.broken = False
        response = http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 200
        metrics = http.get(f"{url}/metrics").text
        assert "tandem:num_requests_in_flight 0.0" in metrics


def test_middleware_added_later_sees_the_generation_routes(tokenizer, http):
    """The direct path of the generation routes gives way once the app has middleware of
    its own: middleware added after ``create_app`` runs for ``/v1/completions`` and
    ``/v1/chat/completions`` as for any other route, and the answers are the same."""
    from starlette.middleware.base import BaseHTTPMiddleware

    app = create_app(NullBackend(tokenizer, max_model_len=MAX_MODEL_LEN))
    seen: list[str] = []

    async def mark(request, call_next):
        seen.append(request.url.path)
        response = await call_next(request)
        response.headers["x-marked"] = "1"
        return response

    app.add_middleware(BaseHTTPMiddleware, dispatch=mark)
    with serve_in_thread(app) as url:
        for path, body in (
            ("completions", {"prompt": "x", "max_tokens": 3, "stream": True}),
            ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            response = http.post(f"{url}/v1/{path}", json={"model": "tiny", **body})
            assert response.status_code == 200
            assert response.headers["x-marked"] == "1"
        assert seen == ["/v1/completions", "/v1/chat/completions"]
        assert (
            "data: [DONE]"
            in http.post(
                f"{url}/v1/completions",
                json={"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True},
            ).text
        )


# ---- metrics ---------------------------------------------------------------------


def test_metrics_names(client, url, http):
    client.completions.create(model="tiny", prompt="hello", max_tokens=4)
    text = http.get(f"{url}/metrics").text
    for name in (
        "tandem:time_to_first_token_seconds_bucket",
        "tandem:inter_token_latency_seconds_count",
        "tandem:e2e_request_latency_seconds_sum",
        "tandem:request_queue_time_seconds_count",
        "tandem:prompt_tokens_total",
        "tandem:generation_tokens_total",
        'tandem:request_success_total{finished_reason="length"}',
        'tandem:num_requests_running{engine="null-0",role="colocated"}',
        'tandem:num_requests_waiting{engine="null-0",role="colocated"}',
        'tandem:kv_cache_usage_perc{engine="null-0",role="colocated"}',
        'tandem:num_preemptions_total{engine="null-0",role="colocated"}',
        'tandem:prefix_cache_hits_total{engine="null-0",role="colocated"}',
        'tandem:kv_transfer_bytes_total{engine="null-0",role="colocated"}',
        'tandem:kv_transfer_seconds_bucket{engine="null-0",le="0.01",role="colocated"}',
        'tandem:disagg_decisions_total{path="local"}',
    ):
        assert name in text, name


def test_metrics_counts(tokenizer, http):
    with running(NullBackend(tokenizer)) as url:
        client = make_client(url, http)
        client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4)
        client.completions.create(model="tiny", prompt=[1, 2], max_tokens=6, stream=True)
        lines = http.get(f"{url}/metrics").text.splitlines()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line and not line.startswith("#")
    }
    assert values["tandem:prompt_tokens_total"] == 5
    assert values["tandem:generation_tokens_total"] == 10
    assert values['tandem:request_success_total{finished_reason="length"}'] == 2
    assert values['tandem:time_to_first_token_seconds_count{path="local"}'] == 2
    assert values['tandem:inter_token_latency_seconds_count{path="local"}'] == 3 + 5
    assert values['tandem:e2e_request_latency_seconds_count{path="local"}'] == 2
    assert values["tandem:num_requests_in_flight"] == 0


# ---- client disconnect -----------------------------------------------------------


@pytest.fixture
def slow_server(tokenizer):
    backend = NullBackend(tokenizer, output_interval_s=0.01, max_model_len=100_000)
    with running(backend) as url:
        yield backend, url


def test_disconnect_mid_stream_aborts(slow_server, http):
    backend, url = slow_server
    body = {"prompt": "x", "max_tokens": 50_000, "stream": True}
    with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        # Keep a reference to the line iterator: closing it closes the connection.
        lines = response.iter_lines()
        first = next(lines)
        request_id = json.loads(first.removeprefix("data: "))["id"]
        assert backend.num_running == 1
        assert next(lines) == ""  # the blank line that ends the event
    wait_until(lambda: request_id in backend.aborted_request_ids)
    wait_until(lambda: backend.num_running == 0)
    metrics = http.get(f"{url}/metrics").text
    assert 'tandem:request_success_total{finished_reason="abort"} 1.0' in metrics


def test_disconnect_before_response_aborts(slow_server):
    """Non-streaming: nothing is sent until the end, so only the receive
    channel can tell that the client left."""
    backend, url = slow_server
    body = json.dumps({"prompt": "x", "max_tokens": 50_000}).encode()
    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: backend.num_running == 1)
    wait_until(lambda: len(backend.aborted_request_ids) == 1)
    wait_until(lambda: backend.num_running == 0)
    assert backend.aborted_request_ids[0].startswith("cmpl-")


# ---- n > 1 (the backend sends each choice with its index) -----------------------------


def test_completion_n3_one_choice_each_and_usage_counts_all(client, backend):
    response = client.completions.create(model="tiny", prompt="hello", max_tokens=6, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.text == expected_text(backend, 6) for c in response.choices)
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 18


def test_completion_n3_stream_chunks_carry_their_index(client, backend):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hello",
            max_tokens=5,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *token_chunks, usage_chunk = chunks
    for index in range(3):
        mine = [c.choices[0] for c in token_chunks if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == expected_text(backend, 5)
        assert [c.finish_reason for c in mine] == [None] * 4 + ["length"]
    assert usage_chunk.usage.completion_tokens == 15


def test_chat_n2_stream_role_chunk_per_choice(client, backend):
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, n=2, stream=True
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    for index in range(2):
        text = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == index
        )
        assert text == expected_text(backend, 4)


def test_chat_n2_message_per_choice(client, backend):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.content == expected_text(backend, 4) for c in response.choices)
    assert response.usage.completion_tokens == 8


def test_stop_string_ends_every_choice_then_aborts(client, backend):
    response = client.completions.create(model="tiny", prompt="x", max_tokens=40, n=2, stop="fox")
    assert [c.text for c in response.choices] == ["The quick brown "] * 2
    assert [c.finish_reason for c in response.choices] == ["stop"] * 2
    wait_until(lambda: response.id in backend.aborted_request_ids)
