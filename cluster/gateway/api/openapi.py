"""The gateway's OpenAPI 3.1 document (``GET /openapi.json``).

Request bodies come from the msgspec structs the gateway decodes with
(``msgspec.json.schema_components``), so every field and type is the one
the server reads; ``_RULES`` then adds the value rules the gateway enforces
after decoding (``protocol.validate_common`` and friends), and the served
model names and the vocabulary size fill in ``model`` and token-id ranges.
Every 4xx/5xx is declared with the OpenAI error envelope.

``tests/cluster/test_openapi_fuzz.py`` runs schemathesis against a live
gateway: a request this document calls invalid must get a 4xx, nothing may
get a 5xx, every error must be the envelope. A rule changed in the
protocol without this table (or the reverse) fails it. What a schema cannot
say (a prompt's token count against the context, ``min_tokens <=
max_tokens``, ``stream_options`` only with ``stream``) is in the
operation's description and answered 400.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import msgspec

from tandem.cluster.gateway.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from tandem.cluster.gateway.protocol import ChatCompletionRequest, CompletionRequest
from tandem.scheduler.fork import MAX_N

_NULL = {"type": "null"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL]}


def _only(value: Any) -> dict[str, Any]:
    """Accepted only at its neutral value (a field read but not supported)."""
    return _nullable({"const": value})


_NONEMPTY = {"type": "string", "minLength": 1}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": _NONEMPTY,
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
        },
    },
}

# field -> its schema, for every request struct that has the field ("{TOKEN}":
# a token id of this vocabulary). Keep in step with cluster/gateway/protocol.py and
# cluster/gateway/edge/sampling.py.
_RULES: dict[str, Any] = {
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
    "temperature": _nullable({"type": "number", "minimum": 0}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "minimum": -1}),
    "min_tokens": _nullable({"type": "integer", "minimum": 0}),
    "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
    "priority": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
    "best_of": _only(1),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "prompt_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": "{MAX_LOGPROBS}"}),
    # keys: token ids of the vocabulary, as decimal strings (400 otherwise)
    "logit_bias": _nullable(
        {
            "type": "object",
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
    # each word must have a non-space character (400 otherwise)
    "bad_words": _nullable({"type": "array", "items": _NONEMPTY}),
    "suffix": _nullable({"type": "string", "maxLength": 0}),
    # checked by cluster/gateway/tools/request.py and cluster/gateway/edge/structured.py
    "tools": _nullable({"type": "array", "items": {"type": "object"}}),
    "response_format": _nullable({"type": "object"}),
    "stop": _nullable({"anyOf": [_NONEMPTY, {"type": "array", "items": _NONEMPTY}]}),
    "cache_salt": _nullable(_NONEMPTY),
    "stop_token_ids": _nullable({"type": "array", "items": "{TOKEN}"}),
    "tokens": {"type": "array", "items": "{TOKEN}"},
    "messages": _MESSAGES,
    "continue_final_message": {"const": False},
}
# per struct, where one field name means different things
_STRUCT_RULES: dict[str, dict[str, Any]] = {
    "CompletionRequest": {
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": "{MAX_LOGPROBS}"}),
        # one prompt: text, token ids, or a list holding one of those
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"$ref": "#/components/schemas/TokenIds"},
                {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {"$ref": "#/components/schemas/TokenIds"},
                },
            ]
        },
    },
    "ChatCompletionRequest": {
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": "{MAX_LOGPROBS}"}),
    },
    "TokenizeChatRequest": {"add_special_tokens": {"const": False}},
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _nullable({"type": "string"}),
                "code": _nullable({"type": "string"}),
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}


def _response(object_name: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": object_name},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


_FINISH = _nullable({"type": "string"})
_COMPLETION = _response(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "text": {"type": "string"}},
    },
)
_CHAT = _response(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
            },
            "finish_reason": _FINISH,
        },
    },
)
_MODELS = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "owned_by", "max_model_len"],
                "properties": {"id": {"type": "string"}, "max_model_len": {"type": "integer"}},
            },
        },
    },
}
_HEALTH = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"enum": ["ok", "unavailable"]}, "reason": {"type": "string"}},
}

_REQUEST_TYPES = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
    TokenizeResponse,
    DetokenizeResponse,
)


@functools.cache
def _struct_components() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        _REQUEST_TYPES, ref_template="#/components/schemas/{name}"
    )
    return components


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: str) -> dict[str, Any]:
    described = {
        "4XX": "Refused: the OpenAI error envelope (400 bad field, 401 API key, "
        "404 model or route, 413 body too large).",
        "500": "The engine failed the request (engine_error).",
        "503": "No ready engine, or --max-num-requests reached (Retry-After).",
        "504": "The request passed --request-timeout-s.",
    }
    return {c: {"description": described[c], **_json(_ref("Error"))} for c in codes}


def _post(summary: str, body: dict[str, Any], ok: dict[str, Any], *errors: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, **_json(body)},
            "responses": {"200": {"description": "OK", **ok}, **_errors("4XX", *errors)},
        }
    }


def openapi_schema(
    model_names: tuple[str, ...], vocab_size: int, max_logprobs: int, api_key_required: bool
) -> dict[str, Any]:
    """The whole document for a gateway serving ``model_names`` with a
    vocabulary of ``vocab_size`` tokens and ``--max-logprobs``."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    schemas = copy.deepcopy(_struct_components())
    for name, schema in schemas.items():
        properties = schema.get("properties", {})
        rules = {**_RULES, **_STRUCT_RULES.get(name, {})}
        for field in properties:
            if field == "model":
                properties[field] = _nullable({"enum": list(model_names)})
            elif field in rules:
                properties[field] = rules[field]
    schemas.update(
        TokenIds={"type": "array", "minItems": 1, "items": token_id},
        Error=_ERROR,
        CompletionResponse=_COMPLETION,
        ChatCompletionResponse=_CHAT,
        ModelList=_MODELS,
        Health=_HEALTH,
    )
    _fill(schemas, {"{TOKEN}": token_id, "{MAX_LOGPROBS}": max_logprobs})
    # stream=true: server-sent events, each `data: <chunk JSON>`, the last `data: [DONE]`
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
    stream = {"text/event-stream": {"schema": event}}

    def generation(summary: str, request: str, response: str) -> dict[str, Any]:
        body = {"content": {**_json(_ref(response))["content"], **stream}}
        return _post(summary, _ref(request), body, "500", "503", "504")

    paths: dict[str, Any] = {
        "/v1/completions": generation(
            "Text completion (stream or not). A prompt with no room left in the "
            "context for max_tokens is a 400 context_length_exceeded.",
            "CompletionRequest",
            "CompletionResponse",
        ),
        "/v1/chat/completions": generation(
            "Chat completion (stream or not); stream_options needs stream=true, "
            "top_logprobs needs logprobs=true, min_tokens <= max_tokens.",
            "ChatCompletionRequest",
            "ChatCompletionResponse",
        ),
        "/tokenize": _post(
            "Prompt tokens (vLLM's shape): a prompt or chat messages.",
            {"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]},
            _json(_ref("TokenizeResponse")),
        ),
        "/detokenize": _post(
            "Text of token ids (vLLM's shape).",
            _ref("DetokenizeRequest"),
            _json(_ref("DetokenizeResponse")),
        ),
        "/v1/models": {
            "get": {
                "summary": "The served model names.",
                "responses": {"200": {"description": "OK", **_json(_ref("ModelList"))}},
            }
        },
        "/health": {
            "get": {
                "summary": "200 when every pool has a ready engine, else 503.",
                "responses": {
                    "200": {"description": "Ready", **_json(_ref("Health"))},
                    "503": {"description": "Not ready", **_json(_ref("Health"))},
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics.",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tandem", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key_required:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
                    operation["responses"].update(_errors("4XX"))
    return document


def _fill(node: Any, values: dict[str, Any]) -> None:
    """Replace the ``"{...}"`` placeholders of the rule tables in place."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str) and value in values:
                node[key] = values[value]
            else:
                _fill(value, values)
    elif isinstance(node, list):
        for item in node:
            _fill(item, values)
