"""A request's output constraint, from whichever spelling the client used, checked before any
engine work (400 naming the field):

    response_format      {"type": "text" | "json_object"}
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   vLLM's: exactly one of {"json", "regex", "choice", "grammar",
                         "json_object"}
    guided_json / guided_regex / guided_choice / guided_grammar     vLLM's older spellings

At most one of them per request (tools with ``tool_choice`` "required" or a named function bring
their own, ``cluster/gateway/tools/``). The spec is validated with llguidance, the library the
engines compile with (``workers/structured/spec.py``; torch-free), so what passes here compiles
on every engine.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.cluster.gateway.protocol import ProtocolError
from tandem.wire.engine_protocol import StructuredOutputsParams
from tandem.workers.structured import spec as specs

# vLLM's structured_outputs keys that pick the constraint, and the ones that tune it (accepted,
# their defaults are ours: no free whitespace in JSON)
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_TUNING = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
           "whitespace_pattern", "backend")  # fmt: skip
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _spec(kind: str, value: Any, param: str) -> StructuredOutputsParams:
    """One constraint from its JSON value; ProtocolError naming ``param``."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ProtocolError(f"{param} must be a JSON schema.", param=param) from None
        if not isinstance(value, dict | bool):
            raise ProtocolError(f"{param} must be a JSON schema (an object).", param=param)
        text = json.dumps(value)
    elif kind == "json_object":
        if value is not True:
            raise ProtocolError(f"{param} must be true when given.", param=param)
        text = ""
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ProtocolError(f"{param} must be a list of strings.", param=param)
        if not value:
            raise ProtocolError(f"{param} must not be empty.", param=param)
        text = json.dumps(value)
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise ProtocolError(f"{param} must be a non-empty string.", param=param)
        text = value
    spec = StructuredOutputsParams(kind, text)
    check(spec, param)
    return spec


def check(spec: StructuredOutputsParams, param: str) -> None:
    try:
        specs.check(spec)
    except ValueError as exc:
        raise ProtocolError(f"{param}: {exc}.", param=param) from None


def _from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict):
        raise ProtocolError("response_format must be an object.", param="response_format")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams("json_object")
    if kind == "json_schema":
        body = fmt.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(body, dict):
            raise ProtocolError(f"{param} must be an object.", param=param)
        name = body.get("name")
        if name is not None and not (isinstance(name, str) and name):
            raise ProtocolError(f"{param}.name must be a non-empty string.", param=f"{param}.name")
        schema = body.get("schema", body.get("schema_"))
        if schema is None:
            return StructuredOutputsParams("json_object")  # no schema: any JSON object
        return _spec("json", schema, f"{param}.schema")
    raise ProtocolError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
        param="response_format.type",
    )


def _from_structured_outputs(body: Any) -> StructuredOutputsParams:
    if not isinstance(body, dict):
        raise ProtocolError("structured_outputs must be an object.", param="structured_outputs")
    unknown = [k for k in body if k not in _KINDS and k not in _TUNING]
    if unknown:
        raise ProtocolError(
            f"structured_outputs.{unknown[0]} is not supported.",
            param=f"structured_outputs.{unknown[0]}",
        )
    given = [k for k in _KINDS if body.get(k) not in (None, False)]
    if len(given) != 1:
        raise ProtocolError(
            f"structured_outputs needs exactly one of {', '.join(_KINDS)}, got "
            f"{', '.join(given) or 'none'}.",
            param="structured_outputs",
        )
    kind = given[0]
    return _spec(kind, body[kind], f"structured_outputs.{kind}")


def request_spec(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None: unconstrained)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if req.structured_outputs is not None:
        found.append((_from_structured_outputs(req.structured_outputs), "structured_outputs"))
    for field, kind in _GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            found.append((_spec(kind, value, field), field))
    if len(found) > 1:
        raise ProtocolError(
            f"{found[1][1]} cannot be combined with {found[0][1]}: give one output constraint.",
            param=found[1][1],
        )
    return found[0] if found else (None, None)
