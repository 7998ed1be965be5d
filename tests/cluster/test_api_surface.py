"""/tokenize, /detokenize, --served-model-name, --chat-template and
--generation-config through a real uvicorn gateway (NullBackend, tiny
tokenizer). Oracles: the tokenizer itself and the official openai client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tandem.cluster.gateway.api.config import ApiConfig, ApiSettings
from tandem.cluster.gateway.api.generation_defaults import load_generation_defaults
from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.workers.checkpoints.tiny import build_tokenizer
from tandem.workers.text.tokenizer import apply_chat_template, encode_prompt
from tests.cluster.recording_backend import RecordingBackend

MESSAGES = [{"role": "user", "content": "Hello there, tandem!"}]
TEMPLATE = "{% for m in messages %}[[{{ m['role'] }}]] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def server(tokenizer):
    backend = RecordingBackend(tokenizer, max_model_len=256)
    api = ApiConfig(served_model_names=("tiny-a", "tiny-b"))
    with serve_in_thread(create_app(backend, api=api)) as url:
        yield backend, url


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def test_tokenize_completion_form_matches_the_tokenizer(server, tokenizer):
    _, url = server
    text = "The quick brown fox"
    r = post(url, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = encode_prompt(tokenizer, text)
    assert body["tokens"] == expected
    assert body["count"] == len(expected)
    assert body["max_model_len"] == 256
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    bare = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None


def test_tokenize_chat_form_counts_what_chat_completions_runs(server, tokenizer):
    backend, url = server
    r = post(url, "/tokenize", {"messages": MESSAGES, "model": "tiny-b"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == apply_chat_template(tokenizer, MESSAGES, True)
    chat = oai(url).chat.completions.create(model="tiny-a", messages=MESSAGES, max_tokens=3)
    assert chat.usage.prompt_tokens == r.json()["count"]
    assert backend.requests[-1].prompt_token_ids == r.json()["tokens"]


def test_detokenize_round_trip_and_bad_ids(server, tokenizer):
    _, url = server
    tokens = tokenizer.encode("jumps over the lazy dog", add_special_tokens=False)
    r = post(url, "/detokenize", {"tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.decode(tokens)}
    bad = post(url, "/detokenize", {"tokens": [0, len(tokenizer)]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"
    assert post(url, "/detokenize", {"tokens": "abc"}).json()["error"]["param"] == "tokens"
    assert post(url, "/tokenize", {"messages": []}).json()["error"]["param"] == "messages"
    assert post(url, "/tokenize", {}).status_code == 400


def test_served_model_names(server):
    _, url = server
    client = oai(url)
    assert [m.id for m in client.models.list().data] == ["tiny-a", "tiny-b"]
    r = client.completions.create(model="tiny-b", prompt="Hi", max_tokens=2)
    assert r.model == "tiny-b"  # the name the request used
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.json()["model"] == "tiny-a"  # none given: the first name
    for call in (
        lambda: client.completions.create(model="tiny", prompt="Hi", max_tokens=2),
        lambda: client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "model_not_found"
        assert info.value.body["param"] == "model"
    r = post(url, "/tokenize", {"prompt": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_template_file_replaces_the_tokenizers(tmp_path, tokenizer):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    api = ApiConfig.from_settings(ApiSettings(chat_template=str(path)), None)
    backend = RecordingBackend(build_tokenizer(), max_model_len=256)
    with serve_in_thread(create_app(backend, api=api)) as url:
        tokens = post(url, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
        oai(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    expected = tokenizer.encode("[[user]] Hello there, tandem!\n", add_special_tokens=False)
    assert tokens == expected
    assert backend.requests[-1].prompt_token_ids == expected
    with pytest.raises(ValueError, match="--chat-template"):
        ApiConfig.from_settings(ApiSettings(chat_template=str(tmp_path / "missing.jinja")), None)


def _generation_config(tmp_path, **values):
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return str(tmp_path)


def test_generation_config_defaults_apply_when_the_request_omits_them(tmp_path):
    folder = _generation_config(
        tmp_path, temperature=0.3, top_p=0.9, top_k=7, max_new_tokens=5, do_sample=True
    )
    defaults = load_generation_defaults("auto", folder)
    assert defaults.values == {"temperature": 0.3, "top_p": 0.9, "top_k": 7, "max_tokens": 5}
    assert load_generation_defaults("vllm", folder).values == {}
    assert load_generation_defaults(folder, None).values == defaults.values
    backend = RecordingBackend(build_tokenizer(), max_model_len=256)
    api = ApiConfig(generation_defaults=defaults)
    with serve_in_thread(create_app(backend, api=api)) as url:
        client = oai(url)
        r = client.completions.create(model="tiny", prompt="Hi", extra_body={"ignore_eos": True})
        params = backend.requests[-1].sampling_params
        assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.9, 7)
        assert params.max_tokens == 5 and r.usage.completion_tokens == 5
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=0.0, top_p=0.5, max_tokens=3
        )
        params = backend.requests[-1].sampling_params
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (
            0.0,
            0.5,
            7,
            3,
        )


def test_generation_config_default_max_tokens_is_cut_to_the_context(tmp_path):
    defaults = load_generation_defaults("auto", _generation_config(tmp_path, max_new_tokens=10_000))
    backend = RecordingBackend(build_tokenizer(), max_model_len=64)
    with serve_in_thread(create_app(backend, api=ApiConfig(generation_defaults=defaults))) as url:
        oai(url).completions.create(model="tiny", prompt="Hi there")
    request = backend.requests[-1]
    assert request.sampling_params.max_tokens == 64 - len(request.prompt_token_ids)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_generation_config_bad_values_name_the_field(tmp_path, values, field):
    with pytest.raises(ValueError, match=f"--generation-config.*{field}"):
        load_generation_defaults("auto", _generation_config(tmp_path, **values))
    with pytest.raises(ValueError, match="--generation-config"):
        load_generation_defaults(str(tmp_path / "nowhere"), None)
