"""Structured outputs and tools at the gateway (NullBackend, real uvicorn, the openai client):
every bad spec, tool and tool_choice is a 400 in the OpenAI envelope naming the field, before
any engine work (the backend never sees the request); good ones reach the engine request as a
``StructuredOutputsParams``; tool-call responses have OpenAI's shape, streamed or not. The
constrained generation itself is tested on real engines (tests/cluster/test_structured_service.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tandem.cluster.gateway.api.config import ApiConfig
from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.cluster.gateway.tools.parsers import HermesParser, RequiredParser
from tandem.workers.checkpoints.tiny import build_tokenizer

C, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class RecordingBackend(NullBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = []

    async def generate(self, request):
        self.seen.append(request)
        async for out in super().generate(request):
            yield out


@pytest.fixture(scope="module")
def server():
    backend = RecordingBackend(build_tokenizer(), max_model_len=256)
    api = ApiConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(create_app(backend, api=api)) as url:
        yield backend, url


@pytest.fixture(scope="module")
def http():
    with httpx.Client() as client:
        yield client


def chat(**fields):
    return {"messages": MESSAGES, "max_tokens": 4, **fields}


BAD = [
    (
        C,
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "nope"}},
            },
        },
        "response_format.json_schema.schema",
    ),  # noqa: E501
    (
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "("}},
            }
        ),
        "response_format.json_schema.schema",
    ),  # noqa: E501
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format.type"),
    (CHAT, chat(response_format="json"), "response_format"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    (C, {"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    (C, {"prompt": "x", "structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    (
        C,
        {"prompt": "x", "structured_outputs": {"grammar": "root ::= foo"}},
        "structured_outputs.grammar",
    ),  # noqa: E501
    (C, {"prompt": "x", "structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    (
        C,
        {"prompt": "x", "structured_outputs": {"json": {"$ref": "#/$defs/missing"}}},
        "structured_outputs.json",
    ),  # noqa: E501
    (C, {"prompt": "x", "structured_outputs": {}}, "structured_outputs"),
    (
        C,
        {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
    ),  # noqa: E501
    (
        C,
        {"prompt": "x", "structured_outputs": {"structural_tag": "x"}},
        "structured_outputs.structural_tag",
    ),  # noqa: E501
    (C, {"prompt": "x", "guided_regex": "(("}, "guided_regex"),
    (C, {"prompt": "x", "guided_choice": []}, "guided_choice"),
    (
        C,
        {"prompt": "x", "guided_json": {"type": "integer", "minimum": 5, "maximum": 1}},
        "guided_json",
    ),  # noqa: E501
    (C, {"prompt": "x", "guided_grammar": "start: "}, None),  # valid: an empty language
    (C, {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"parameters": {}}}]),
        "tools[0].function.name",
    ),  # noqa: E501
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        "tools[0].function.name",
    ),  # noqa: E501
    (CHAT, chat(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
        ),
        "tools[0].function.parameters",
    ),  # noqa: E501
    (
        CHAT,
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice.function.name",
    ),  # noqa: E501
    (CHAT, chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (CHAT, chat(tools=[WEATHER], tool_choice="required", guided_regex="a"), "guided_regex"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_spec_is_400_before_any_engine_work(server, http, path, body, param):
    backend, url = server
    before = len(backend.seen)
    r = http.post(url + path, json=body)
    if param is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert len(backend.seen) == before  # refused before reaching the backend


def test_auto_needs_the_flags(http):
    backend = NullBackend(build_tokenizer(), max_model_len=256)
    with serve_in_thread(create_app(backend)) as url:
        r = http.post(url + CHAT, json=chat(tools=[WEATHER]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        r = http.post(url + CHAT, json=chat(tools=[WEATHER], tool_choice="none"))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_flags_are_checked():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ApiConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ApiConfig(tool_call_parser="nope")


@pytest.mark.parametrize(
    ("fields", "kind", "text"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "integer"}},
                }
            },  # noqa: E501
            "json",
            '{"type": "integer"}',
        ),  # fmt: skip
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", '["a", "b"]'),
        (
            {"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}},
            "regex",
            "[0-9]+",
        ),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
        ({"guided_json": '{"type": "boolean"}'}, "json", '{"type": "boolean"}'),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)
def test_spec_reaches_the_engine_request(server, http, fields, kind, text):
    backend, url = server
    for path, body in ((C, {"prompt": "x", "max_tokens": 2}), (CHAT, chat())):
        r = http.post(url + path, json={**body, **fields})
        assert r.status_code == 200, r.text
        so = backend.seen[-1].sampling_params.structured_outputs
        assert (so.kind, so.text) == (kind, text) if kind else so is None


def test_required_and_named_tool_choice_constrain_the_request(server, http):
    backend, url = server
    r = http.post(
        url + CHAT, json=chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    )
    assert r.status_code == 200
    schema = json.loads(backend.seen[-1].sampling_params.structured_outputs.text)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {
        "const": "get_weather"
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = http.post(url + CHAT, json=chat(tools=[WEATHER], tool_choice=named))
    assert r.status_code == 200
    spec = backend.seen[-1].sampling_params.structured_outputs
    assert json.loads(spec.text) == WEATHER["function"]["parameters"]


def test_tool_call_shape_named_streamed_and_not(server, http):
    """The NullBackend's text becomes the named function's arguments (unconstrained here)."""
    _, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       tools=[WEATHER], tool_choice=named)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function" and call.id
    assert r.choices[0].message.content is None
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                            tools=[WEATHER], tool_choice=named, stream=True)  # fmt: skip
    deltas = [tc for c in stream for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert deltas[0].function.name == "get_weather" and deltas[0].id == deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_required_parser_streams_argument_deltas():
    text = (
        '[{"name":"get_weather","parameters":{"city":"Pa,r}i\\"s"}},{"name":"f","parameters":{}}]'
    )
    for step in (1, 3, len(text)):
        parser = RequiredParser()
        deltas = [d for i in range(0, len(text), step) for d in parser.feed(text[i : i + step])[1]]
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls
        ] == [
            ("get_weather", {"city": 'Pa,r}i"s'}),
            ("f", {}),
        ]
        assert [d["function"].get("name") for d in deltas if "id" in d] == ["get_weather", "f"]


def test_hermes_parser_keeps_content_and_reads_calls():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for step in (1, 5, len(text)):
        parser = HermesParser()
        content = "".join(parser.feed(text[i : i + step])[0] for i in range(0, len(text), step))
        content += parser.finish()[0]
        assert content == "Let me check."
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls] == [
            ("get_weather", '{"city": "Oslo"}')
        ]
    parser = HermesParser()
    assert parser.feed("a <tool_call>{broken")[0] == "a "
    assert parser.finish()[0] == "<tool_call>{broken" and not parser.calls


def test_auto_tool_choice_reads_hermes_calls(http):
    """--enable-auto-tool-choice --tool-call-parser hermes: the model's (here the NullBackend's)
    text with <tool_call> markup comes back as content plus OpenAI tool calls, streamed or not."""
    tok = build_tokenizer()
    text = (
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    ids = list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]
    backend = NullBackend(tok, max_model_len=512, output_token_ids=ids)
    api = ApiConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(create_app(backend, api=api)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http)
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=200
        )
        message = r.choices[0].message
        assert message.content == "Checking." and r.choices[0].finish_reason == "tool_calls"
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather",
            {"city": "Oslo"},
        )
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=200, stream=True
        )
        chunks = [c.choices[0] for c in stream if c.choices]
        content = "".join(c.delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in c.delta.tool_calls or ()]
        assert content == "Checking." and chunks[-1].finish_reason == "tool_calls"
        assert calls[0].function.name == "get_weather" and calls[0].id
        assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Oslo"}
