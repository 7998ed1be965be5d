"""Structured outputs through the real service on the built-in ``smollm2``: 1 prefill + 1 decode
engine (NIXL handoff; every prompt takes the remote path) and the official openai client.

- ``response_format`` with a JSON schema, and ``client.chat.completions.parse`` with a pydantic
  model, validate;
- streamed tool calls with ``tool_choice: "required"`` carry arguments that validate against the
  tool's parameters; ``tool_choice: "auto"`` reads the engines' hermes markup (forced by a regex);
- the split run equals one colocated engine (``LLM``, same spec) token for token, greedy and
  seeded; ``n > 1`` choices are each valid;
- the engines report the structured-output metrics; ``check_integrity()`` after each scenario.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pydantic
import pytest

from benchmarks.structured_schemas import SCHEMAS
from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tandem.wire.engine_protocol import SamplingParams, StructuredOutputsParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.text.tokenizer import apply_chat_template
from tests import shared_ray
from tests.cluster.service_helpers import client, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16, "max_model_len": 1024}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def service():
    shared_ray.start()
    config = serve_config(
        ray_dashboard=False, prefill=1, decode=1, kv_lease_s=5.0, disagg_min_tokens=4,
        enable_auto_tool_choice=True, tool_call_parser="hermes", **ENGINE,
    )  # fmt: skip
    try:
        with ServiceThread(config) as svc:
            yield svc
    finally:
        shared_ray.release()


@pytest.fixture(scope="module")
def offline():
    with LLM(
        EngineConfig.from_flat(
            model="smollm2", num_kv_blocks=128, max_model_len=1024, torch_threads=1
        )
    ) as llm:
        yield llm


def colocated(llm: LLM, messages, sp: SamplingParams):
    (result,) = llm.generate(
        prompt_token_ids=[apply_chat_template(llm.tokenizer, messages)], sampling_params=sp
    )
    llm.engine.check_integrity()
    return result


def test_response_format_schema_split_equals_colocated(service, offline):
    c = client(service, timeout_s=180)
    for name, temperature, seed in (
        ("ref", 0.0, None),
        ("mixed", 0.9, 42),
        ("array_of_objects", 0.7, 7),
    ):
        schema = SCHEMAS[name]
        messages = [{"role": "user", "content": f"Give me a {name} record as JSON."}]
        r = c.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=120, temperature=temperature, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        )  # fmt: skip
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (name, text, r.choices[0].finish_reason)
        jsonschema.validate(json.loads(text), schema)
        sp = SamplingParams(max_tokens=120, temperature=temperature, seed=seed,
                            structured_outputs=StructuredOutputsParams("json", json.dumps(schema)))  # fmt: skip
        want = colocated(offline, messages, sp)
        assert (text, r.usage.completion_tokens, r.choices[0].finish_reason) == (
            want.text,
            len(want.token_ids),
            want.finish_reason,
        ), name
    wait_idle(service)


def test_completions_regex_choice_and_grammar_split_equal_colocated(service, offline):
    c = client(service, timeout_s=180)
    prompt = "The three primary colors are red, yellow and"
    cases = [
        (
            {"structured_outputs": {"choice": ["blue", "green", "purple"]}},
            StructuredOutputsParams("choice", '["blue", "green", "purple"]'),
        ),  # noqa: E501
        (
            {"guided_regex": "( [a-z]+){2,4}\\."},
            StructuredOutputsParams("regex", "( [a-z]+){2,4}\\."),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= " " ("blue" | "green") "!"'}},
            StructuredOutputsParams("grammar", 'root ::= " " ("blue" | "green") "!"'),
        ),  # fmt: skip
    ]
    ids = offline.tokenizer.encode(prompt)
    for extra, spec in cases:
        r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0.8,
                                 seed=3, extra_body=extra)  # fmt: skip
        (want,) = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            max_tokens=24, temperature=0.8, seed=3, structured_outputs=spec))  # fmt: skip
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop", (
            extra,
            want,
        )
    wait_idle(service)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    pets: list[str] = pydantic.Field(max_length=2)


def test_openai_parse_with_a_pydantic_model(service):
    c = client(service, timeout_s=180)
    r = c.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person, max_tokens=120, temperature=0,
    )  # fmt: skip
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    wait_idle(service)


def test_streamed_required_tool_calls_validate(service):
    c = client(service, timeout_s=180)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in (1, 2):
        stream = c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What's the weather in Paris?"}],
            tools=[WEATHER, TIME], tool_choice="required", stream=True, max_tokens=160,
            temperature=0.8, seed=seed,
        )  # fmt: skip
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for d in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(d.index, {"name": None, "arguments": "", "id": None})
                if d.id:
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and calls, calls
        for call in calls.values():
            assert call["id"] and call["name"] in params
            jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])
    wait_idle(service)


def test_auto_tool_choice_parses_a_real_engines_hermes_markup(service):
    """``tool_choice: "auto"`` with ``--tool-call-parser hermes`` on the real split engines.
    SmolLM2 never writes hermes markup on its own, so the request also carries a regex
    ``structured_outputs``, which vLLM's API (and ours) accepts next to ``auto``: the engines
    write the markup token by token, and the gateway's parser turns their detokenized stream
    into content and OpenAI tool calls, streamed and not. What this cannot test is the model
    choosing to call a tool; that is the model's behaviour, not the server's."""
    c = client(service, timeout_s=180)
    markup = (
        r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,12}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
    )
    ask = dict(
        model="smollm2", messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=[WEATHER, TIME], max_tokens=80, temperature=0,
        extra_body={"structured_outputs": {"regex": markup}},
    )  # fmt: skip
    r = c.chat.completions.create(**ask)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", message
    assert message.content == "Checking."
    (call,) = message.tool_calls
    assert call.id and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    chunks = [ch.choices[0] for ch in c.chat.completions.create(**ask, stream=True) if ch.choices]
    deltas = [d for ch in chunks for d in ch.delta.tool_calls or ()]
    assert "".join(ch.delta.content or "" for ch in chunks) == "Checking."
    assert chunks[-1].finish_reason == "tool_calls" and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments
    wait_idle(service)


def test_n_choices_each_valid_and_metrics(service):
    schema = SCHEMAS["nested"]
    c = client(service, timeout_s=180)
    r = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A user as JSON."}], n=3,
        max_tokens=100, temperature=1.0, seed=5,
        extra_body={"structured_outputs": {"json": schema}},
    )  # fmt: skip
    assert len(r.choices) == 3
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    wait_idle(service)
    metrics = httpx.get(service.base_url + "/metrics", timeout=30).text
    counts = {
        line.split("{")[1].split("}")[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("tandem:structured_output_requests_total{")
    }
    assert len(counts) == 2 and all(v > 0 for v in counts.values()), counts
    assert "tandem:structured_output_mask_seconds_bucket" in metrics
