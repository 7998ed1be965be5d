"""schemathesis against a live gateway (uvicorn + NullBackend, tiny tokenizer).

Per operation of ``/openapi.json``, a bounded number of generated requests,
schema-valid and schema-violating: no response may be a 5xx, a request the
document calls invalid must be refused with a 4xx, every 4xx must be the
OpenAI error envelope, and every response must match the document (status
codes, content types, bodies).
"""

from __future__ import annotations

import collections

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks

from tandem.cluster.gateway.api.config import ApiConfig
from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.workers.checkpoints.tiny import build_tokenizer

MAX_EXAMPLES = 40  # per operation and generation mode

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway_url():
    backend = NullBackend(build_tokenizer(), max_model_len=256)
    api = ApiConfig(served_model_names=("tiny", "tiny-alias"))
    with serve_in_thread(create_app(backend, api=api)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(gateway_url):
    return schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")


OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]


def test_document_lists_every_route(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


@schemathesis.check
def error_envelope(ctx, response, case):
    """Every 4xx/5xx body is ``{"error": {"message", "type", "param", "code"}}``."""
    if response.status_code < 400:
        return None
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    return None


CHECKS = [
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
    openapi_checks.negative_data_rejection,
    error_envelope,
]


# GET routes take no input: nothing to violate, so positive only
CASES = [
    (method, path, mode)
    for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if method == "POST" or mode is GenerationMode.POSITIVE
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_fuzz(api_schema, gateway_url, method, path, mode):
    operation = api_schema[path][method]
    statuses = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        response = case.call(base_url=gateway_url, timeout=30)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.status_code, response.text[:500])
        case.validate_response(response, checks=CHECKS)

    run()
    print(method, path, mode.value, collections.Counter(statuses))
    assert statuses


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        # SSE events were once declared as strings (the fuzzer found it by chance)
        ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 4}, 200),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4},
            200,
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}, 200),
        ("/v1/completions", {"prompt": "hi", "model": "other"}, 404),
        ("/tokenize", {"prompt": "hi", "model": "other"}, 404),
        ("/detokenize", {"tokens": [-1]}, 400),
    ],
)
def test_known_cases_conform(api_schema, gateway_url, path, body, status):
    case = api_schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call(base_url=gateway_url, timeout=30)
    assert response.status_code == status, response.text
    case.validate_response(response, checks=CHECKS)


@pytest.mark.parametrize(
    ("field", "accepted", "refused"),
    [
        ("n", 2, 0),
        ("echo", True, "yes"),
        ("priority", -5, 2**63),
        ("presence_penalty", -2, 2.5),
        ("prompt_logprobs", 1, -1),
    ],
)
def test_field_rules_follow_the_protocol(api_schema, gateway_url, field, accepted, refused):
    """The document and the server agree on both sides of each rule (the
    random search reaches these only by chance)."""
    document = httpx.get(f"{gateway_url}/openapi.json", timeout=30).json()
    rule = document["components"]["schemas"]["CompletionRequest"]["properties"][field]
    validator = jsonschema.Draft202012Validator(rule)
    assert validator.is_valid(accepted) and not validator.is_valid(refused), rule
    operation = api_schema["/v1/completions"]["POST"]
    for value, status in ((accepted, 200), (refused, 400)):
        body = {"prompt": "hi", "max_tokens": 2, field: value}
        case = operation.Case(body=body, media_type="application/json")
        response = case.call(base_url=gateway_url, timeout=30)
        assert response.status_code == status, (field, value, response.text)
        case.validate_response(response, checks=CHECKS)
