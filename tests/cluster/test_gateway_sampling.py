"""Gateway sampling fields over the NullBackend, through a real uvicorn server
and the official openai client: what reaches the engine (SamplingParams),
echo, prompt_logprobs and the --max-logprobs cap. (The engines' effect of
each field is tested in tests/workers/test_sampling_*.py and, end to end,
in tests/cluster/test_service_sampling.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.edge.limits import GatewayLimits
from tandem.workers.checkpoints.tiny import build_tokenizer
from tests.cluster.recording_backend import RecordingBackend

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[tuple[RecordingBackend, str]]:
    backend = RecordingBackend(tokenizer, max_model_len=256)
    app = create_app(backend, limits=GatewayLimits(max_logprobs=30))
    with serve_in_thread(app) as url:
        yield backend, url


@pytest.fixture
def client(server) -> Iterator[openai.OpenAI]:
    with httpx.Client() as http:
        yield openai.OpenAI(
            base_url=f"{server[1]}/v1", api_key="x", max_retries=0, http_client=http, timeout=30
        )


def test_fields_reach_the_engine_as_sampling_params(server, client, tokenizer):
    backend = server[0]
    client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        logit_bias={"65": 100, "66": -100.0},
        extra_body={
            "repetition_penalty": 1.3,
            "min_p": 0.1,
            "bad_words": ["ab"],
            "stop_token_ids": [70],
        },
    )
    sp = backend.requests[-1].sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.5, 1.3)
    assert sp.min_p == 0.1 and sp.logit_bias == {65: 100.0, 66: -100.0}
    assert sp.stop_token_ids == [70]
    words = [tokenizer.encode(t, add_special_tokens=False) for t in ("ab", " ab")]
    assert sp.bad_words_token_ids == words
    # neutral defaults when the fields are absent
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    sp = backend.requests[-1].sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.logit_bias is None and sp.bad_words_token_ids == [] and sp.prompt_logprobs is None


def test_echo_returns_the_prompt_stream_or_not(server, client, backend_text=None):
    backend = server[0]
    expected = backend.tokenizer.decode(backend.token_ids_for(5))
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, echo=True)
    assert r.choices[0].text == "Hello there" + expected
    assert r.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(
            model="tiny", prompt="Hello there", max_tokens=5, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith("Hello there")
    assert "".join(c.choices[0].text for c in chunks) == "Hello there" + expected
    # token ids as the prompt: their text comes back
    ids = backend.tokenizer.encode("abc", add_special_tokens=False)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True)
    assert r.choices[0].text.startswith("abc")


def test_echo_with_logprobs_covers_the_prompt(server, client):
    backend = server[0]
    r = client.completions.create(model="tiny", prompt="Hey", max_tokens=3, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    prompt_ids = backend.requests[-1].prompt_token_ids
    assert backend.requests[-1].sampling_params.prompt_logprobs == 2
    num_prompt = len(prompt_ids)
    assert len(lp.tokens) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [-0.5] * (num_prompt + 2)
    # the prompt's tokens include BOS, which the prompt text does not
    assert lp.tokens[0] == backend.tokenizer.decode(prompt_ids[:1]) == "<s>"
    assert "".join(lp.tokens[1:]) == r.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_prompt_logprobs_shape_completions_and_chat(server, client):
    backend = server[0]
    r = client.completions.create(
        model="tiny", prompt="Hey", max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    prompt_ids = backend.requests[-1].prompt_token_ids
    body = r.choices[0].model_extra["prompt_logprobs"]
    assert body[0] is None and len(body) == len(prompt_ids)
    for token_id, position in zip(prompt_ids[1:], body[1:], strict=True):
        assert position[str(token_id)] == {
            "logprob": -0.5,
            "rank": 1,
            "decoded_token": backend.tokenizer.decode([token_id]),
        }
        assert len(position) == 2  # itself (also its top 1) and one alternative
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    body = r.model_extra["prompt_logprobs"]
    assert body[0] is None and len(body) == len(backend.requests[-1].prompt_token_ids)
    assert all(len(position) == 1 for position in body[1:])
    # without the field, no key
    r = client.completions.create(model="tiny", prompt="Hey", max_tokens=1)
    assert "prompt_logprobs" not in (r.choices[0].model_extra or {})


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "x", "logprobs": 31}, "logprobs"),
        ("completions", {"prompt": "x", "prompt_logprobs": 31}, "prompt_logprobs"),
        ("completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 31},
         "top_logprobs"),
        ("chat/completions", {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True},
         "prompt_logprobs"),
    ],
)  # fmt: skip
def test_logprob_caps_are_400_naming_the_field(server, path, body, param):
    response = httpx.post(f"{server[1]}/v1/{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert "30" in response.json()["error"]["message"] or param == "prompt_logprobs"


def test_logprobs_up_to_the_cap_are_served(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=30
    )
    assert all(len(t.top_logprobs) == 30 for t in r.choices[0].logprobs.content)
