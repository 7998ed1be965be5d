"""Outputs ready together go out as one write, and the client sees the same stream.

A gateway that runs behind its engines finds several outputs of a stream
ready at once (``Backend.num_ready``); ``GenerationResponse._stream`` then
writes their SSE events together. The NullBackend's ``outputs_per_turn``
plays such a gateway. Oracles: the same request against one output per
loop turn (SSE bytes equal up to the id and ``created``), the ``openai``
client's parsed chunks, and the ASGI body messages counted in-process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.workers.checkpoints.tiny import build_tokenizer

MESSAGES = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[int, str]]:
    """One server per ``outputs_per_turn`` (1: a write per token; 4 and 7: batched)."""
    tokenizer = build_tokenizer()
    with (
        serve_in_thread(create_app(NullBackend(tokenizer))) as one,
        serve_in_thread(create_app(NullBackend(tokenizer, outputs_per_turn=4))) as four,
        serve_in_thread(create_app(NullBackend(tokenizer, outputs_per_turn=7))) as seven,
    ):
        yield {1: one, 4: four, 7: seven}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client() as client:
        yield client


def sse_events(http: httpx.Client, url: str, path: str, body: dict) -> list:
    """The stream's events, each request's own id and creation time left out."""
    with http.stream("POST", f"{url}/v1/{path}", json=body, timeout=30) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_bytes())
    *events, last = raw.split(b"\n\n")
    assert last == b""  # every event ends with a blank line
    assert events[-1] == b"data: [DONE]"
    parsed = []
    for event in events[:-1]:
        payload = json.loads(event.removeprefix(b"data: "))
        payload.pop("id"), payload.pop("created")
        parsed.append(payload)
    return parsed


BODIES = [
    ("completions", {"prompt": "hi", "max_tokens": 11}),
    ("completions", {"prompt": "hi", "max_tokens": 9, "n": 3}),
    ("completions", {"prompt": "hi", "max_tokens": 13, "stop": ["fox"], "logprobs": 2}),
    ("chat/completions", {"messages": MESSAGES, "max_tokens": 10}),
    ("chat/completions", {"messages": MESSAGES, "max_tokens": 8, "n": 2, "logprobs": True}),
]


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_batched_stream_has_the_same_events(urls, http, path, body):
    body = {**body, "model": "tiny", "stream": True, "stream_options": {"include_usage": True}}
    expected = sse_events(http, urls[1], path, body)
    assert len(expected) >= 4
    for per_turn in (4, 7):
        assert sse_events(http, urls[per_turn], path, body) == expected


def test_batched_stream_through_the_openai_client(urls, http):
    texts = {}
    for per_turn, url in urls.items():
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http)
        stream = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        *token_chunks, usage_chunk = chunks
        assert token_chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
        assert usage_chunk.usage.completion_tokens == 9
        texts[per_turn] = [c.choices[0].delta.content for c in token_chunks]
    assert texts[4] == texts[7] == texts[1]
    assert len(texts[1]) == 10  # the role chunk, then one chunk per token


def body_messages(backend: NullBackend, num_tokens: int) -> list[bytes]:
    """The ASGI body messages of one streamed completion, in-process."""
    app = create_app(backend)
    request = json.dumps(
        {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": num_tokens, "stream": True}
    ).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2), "headers": [(b"content-type", b"application/json")],
    }  # fmt: skip
    bodies: list[bytes] = []

    async def run() -> None:
        never = asyncio.Event()
        received = False

        async def receive() -> dict:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": request, "more_body": False}
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                bodies.append(message["body"])

        await asyncio.wait_for(app(scope, receive, send), timeout=30)

    asyncio.run(run())
    return bodies


def test_outputs_ready_together_are_one_write():
    tokenizer = build_tokenizer()
    # 11 tokens, 4 per turn: tokens 1-4, 5-8, then 9-11 with [DONE]
    batched = body_messages(NullBackend(tokenizer, outputs_per_turn=4), 11)
    assert len(batched) == 3
    # one per turn: a write per token, the last token's with [DONE]
    single = body_messages(NullBackend(tokenizer), 11)
    assert len(single) == 11
    assert b"".join(batched).count(b"data: ") == b"".join(single).count(b"data: ") == 12
    assert batched[-1].endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_the_common_token_short_path_streams_what_the_general_path_does(urls, http, path):
    """``RequestRun.take`` makes a plain request's common token without ``output_step``; a stop
    string the text never contains sends every token through ``output_step`` instead: the
    events are the same, chunk for chunk."""
    body = {"model": "tiny", "max_tokens": 12, "stream": True, "ignore_eos": True}
    body |= {"messages": MESSAGES} if path.startswith("chat") else {"prompt": "hi"}
    body["stream_options"] = {"include_usage": True}
    short = sse_events(http, urls[1], path, body)
    general = sse_events(http, urls[1], path, {**body, "stop": ["#"]})
    assert "#" not in "".join(json.dumps(event) for event in short)
    assert general == short
    assert short[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("index", [0, 2])
def test_the_text_frame_is_the_common_chunk(index):
    """``GenerationResponse._stream`` builds the common chunk from ``text_frame``: the same
    bytes as ``stream_delta(text, None, None)``; a tool-call formatter has none (its parser
    must see every text), unless tool_choice is "none"."""
    from tandem.cluster.gateway.formatting import ChatFormatter, CompletionFormatter, encode_json
    from tandem.cluster.gateway.tools.formatting import ToolChatFormatter
    from tandem.cluster.gateway.tools.request import ToolPlan

    args = ("cmpl-1", "tiny", 7, None, str)
    for formatter in (CompletionFormatter(*args, index=index), ChatFormatter(*args, index=index)):
        prefix, suffix = formatter.text_frame
        for text in ("", " fox", 'a "quoted"\n\u00e9 \U0001f600'):
            assert prefix + encode_json(text) + suffix == formatter.stream_delta(text, None, None)
    auto = ToolPlan("auto", {"f": {}}, parser="hermes")
    assert ToolChatFormatter(*args, plan=auto, index=index).text_frame is None
    plain = ToolChatFormatter(*args, plan=ToolPlan("none", {"f": {}}), index=index)
    assert plain.text_frame == ChatFormatter(*args, index=index).text_frame


def test_text_tails_end_the_common_chunk(monkeypatch):
    """The SSE writer builds the common chunk as ``prefix + tail`` from the shared
    ``text_tails`` table: the same bytes as ``stream_delta``, for a text met the first
    time and again, and after the table was emptied at its bound."""
    from tandem.cluster.gateway import formatting
    from tandem.cluster.gateway.formatting import ChatFormatter, CompletionFormatter
    from tandem.cluster.gateway.tools.formatting import ToolChatFormatter
    from tandem.cluster.gateway.tools.request import ToolPlan

    monkeypatch.setattr(formatting, "_MAX_TEXT_TAILS", 3)
    args = ("cmpl-1", "tiny", 7, None, str)
    texts = ["", " fox", 'a "quoted"\n\u00e9 \U0001f600', " fox", "x", "y", "z", " fox"]
    for formatter in (CompletionFormatter(*args, index=1), ChatFormatter(*args)):
        tails = formatter.text_tails
        prefix = formatter.text_frame[0]
        for text in texts:
            tail = tails.table.get(text)
            if tail is None:
                tail = tails.make(text)
            assert prefix + tail == formatter.stream_delta(text, None, None)
            assert len(tails.table) <= 3
    auto = ToolPlan("auto", {"f": {}}, parser="hermes")
    assert ToolChatFormatter(*args, plan=auto).text_tails is None
