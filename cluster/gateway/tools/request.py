"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, checked before any
engine work (400 naming the field), and what they make of the request:

    tool_choice "none"               no tool calls; the text is the answer
    tool_choice "auto"               the model decides; its text is read by the
                                     --tool-call-parser (needs --enable-auto-tool-choice)
    tool_choice "required"           grammar-constrained: a JSON array of
                                     {"name": <a tool>, "parameters": <its schema>} (one item
                                     when parallel_tool_calls is false)
    {"type": "function",             grammar-constrained: the arguments of that function
     "function": {"name": N}}        (its parameters schema)

Without ``tool_choice`` a request with tools is "auto" (as OpenAI's and vLLM's are).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tandem.cluster.gateway.edge.structured import check
from tandem.cluster.gateway.protocol import ProtocolError
from tandem.wire.engine_protocol import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    functions: dict[str, dict[str, Any]]  # name -> its parameters schema
    named: str | None = None
    parser: str | None = None  # auto: the --tool-call-parser
    spec: StructuredOutputsParams | None = None  # required / named: the constraint
    template_tools: list[dict[str, Any]] | None = None  # what the chat template renders


def _functions(tools: Any) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    if not isinstance(tools, list):
        raise ProtocolError("tools must be a list.", param="tools")
    functions: dict[str, dict[str, Any]] = {}
    rendered = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ProtocolError(f"{where} must be a function tool.", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ProtocolError(f"{where}.function must be an object.", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ProtocolError(
                f"{where}.function.name must be 1-64 letters, digits, '_', '-', '.' or ':'.",
                param=f"{where}.function.name",
            )
        if name in functions:
            raise ProtocolError(f"{where}.function.name {name!r} is repeated.",
                                param=f"{where}.function.name")  # fmt: skip
        params = fn.get("parameters", _ANY_OBJECT)
        if params is None:
            params = _ANY_OBJECT
        if not isinstance(params, dict):
            raise ProtocolError(f"{where}.function.parameters must be a JSON schema object.",
                                param=f"{where}.function.parameters")  # fmt: skip
        check(StructuredOutputsParams("json", json.dumps(params)), f"{where}.function.parameters")
        functions[name] = params
        rendered.append({"type": "function", "function": fn})
    return functions, rendered


def required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``: one or more calls of the tools."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(req: Any, enable_auto: bool, parser: str | None) -> ToolPlan | None:
    """The request's tool plan; None when it has no tools and no tool_choice."""
    choice = req.tool_choice
    if not req.tools:
        if choice in (None, "none"):
            return None
        raise ProtocolError("tool_choice needs tools.", param="tool_choice")
    functions, rendered = _functions(req.tools)
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", functions, template_tools=rendered)
    if choice == "auto":
        if not enable_auto or parser is None:
            raise ProtocolError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser.",
                param="tool_choice",
            )
        return ToolPlan("auto", functions, parser=parser, template_tools=rendered)
    if choice == "required":
        schema = required_schema(functions, parallel)
        spec = StructuredOutputsParams("json", json.dumps(schema))
        check(spec, "tools")
        return ToolPlan("required", functions, spec=spec, template_tools=rendered)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ProtocolError(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}.',
                param="tool_choice",
            )
        if name not in functions:
            raise ProtocolError(f"tool_choice names {name!r}, which is not in tools.",
                                param="tool_choice.function.name")  # fmt: skip
        spec = StructuredOutputsParams("json", json.dumps(functions[name]))
        return ToolPlan("named", functions, named=name, spec=spec, template_tools=rendered)
    raise ProtocolError(
        f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}.',
        param="tool_choice",
    )
