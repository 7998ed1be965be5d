"""Readers of tool calls in a choice's text, incremental: ``feed(text)`` gives the content to
show and the tool-call deltas found so far (OpenAI's streamed shape), ``finish()`` the rest;
``calls`` holds every call whole (the non-streamed response).

    ArgumentsParser    tool_choice names a function: the whole text is its arguments
    RequiredParser     tool_choice "required": [{"name": N, "parameters": {...}}, ...]
                       (compact JSON, as the grammar writes it)
    HermesParser       "auto" with --tool-call-parser hermes:
                       <tool_call>{"name": N, "arguments": {...}}</tool_call> in the text

``PARSERS`` is the registry of ``--tool-call-parser`` names.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

Delta = dict[str, Any]


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallParser:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def _open(self, name: str) -> Delta:
        call = {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                "function": {"name": name, "arguments": ""}}  # fmt: skip

    def _args(self, text: str) -> Delta:
        self.calls[-1]["function"]["arguments"] += text
        return {"index": len(self.calls) - 1, "function": {"arguments": text}}

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[Delta]]:
        return "", []


class ArgumentsParser(ToolCallParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        deltas = [] if self.calls else [self._open(self.name)]
        if text:
            deltas.append(self._args(text))
        return "", deltas

    def finish(self) -> tuple[str, list[Delta]]:
        return "", [] if self.calls else [self._open(self.name)]


class RequiredParser(ToolCallParser):
    """A scanner of ``[{"name":"N","parameters":ARGS},...]``: the name opens a call, ARGS
    stream out as they arrive (their end found by bracket depth outside strings)."""

    _NAME_KEY = '{"name":"'
    _ARGS_KEY = '"parameters":'

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text not consumed yet
        self._state = "item"  # item -> name -> key -> args -> item ...
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        self._buf += text
        deltas: list[Delta] = []
        while self._buf:
            if self._state == "item":
                at = self._buf.find(self._NAME_KEY)
                if at < 0:
                    self._buf = self._buf[-len(self._NAME_KEY) + 1 :]
                    break
                self._buf = self._buf[at + len(self._NAME_KEY) :]
                self._state = "name"
            elif self._state == "name":
                end = self._buf.find('"')
                if end < 0:
                    break
                deltas.append(self._open(json.loads('"' + self._buf[:end] + '"')))
                self._buf = self._buf[end + 1 :]
                self._state = "key"
            elif self._state == "key":
                at = self._buf.find(self._ARGS_KEY)
                if at < 0:
                    break
                self._buf = self._buf[at + len(self._ARGS_KEY) :]
                self._state, self._depth, self._started = "args", 0, False
            else:  # args: pass through up to the end of the value
                end = self._scan_args()
                chunk, self._buf = self._buf[:end], self._buf[end:]
                if chunk:
                    deltas.append(self._args(chunk))
                if self._state == "args":
                    break
        return "", deltas

    def _scan_args(self) -> int:
        """How much of the buffer belongs to the arguments; sets state "item" at their end."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]" or ch == ",":
                if self._depth == 0:  # the end of a scalar value, or of the item
                    self._state = "item"
                    return i
                if ch != ",":
                    self._depth -= 1
                    if self._depth == 0:
                        self._state = "item"
                        return i + 1
            self._started = True
        return len(self._buf)


class HermesParser(ToolCallParser):
    """Hermes-style markup (Qwen, Hermes, many fine-tunes): content outside the tags is
    content; each complete ``<tool_call>...</tool_call>`` is one call, sent whole (name and
    arguments) once its closing tag arrived. A tag cut by a chunk boundary is held back; a
    call that does not parse, or never closes, is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        self._buf += text
        content, deltas = [], []
        while True:
            if not self._inside:
                at = self._buf.find(self.OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:at])
                self._buf = self._buf[at + len(self.OPEN) :]
                self._inside = True
            at = self._buf.find(self.CLOSE)
            if at < 0:
                break
            body, self._buf = self._buf[:at], self._buf[at + len(self.CLOSE) :]
            self._inside = False
            call = _parse_call(body)
            if call is None:
                content.append(self.OPEN + body + self.CLOSE)
            else:
                deltas.append(self._open(call[0]))
                deltas.append(self._args(call[1]))
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[Delta]]:
        rest = (self.OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_call(body: str) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return call["name"], args if isinstance(args, str) else json.dumps(args)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


def parser_for(plan: Any) -> ToolCallParser | None:
    """The parser of a ``ToolPlan`` (None: tool_choice "none", the text is content)."""
    if plan is None or plan.mode == "none":
        return None
    if plan.mode == "named":
        return ArgumentsParser(plan.named)
    if plan.mode == "required":
        return RequiredParser()
    return PARSERS[plan.parser]()
