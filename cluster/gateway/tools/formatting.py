"""The chat response of a request with tools: ``message.tool_calls`` (and ``content`` null when
there is none), streamed as ``delta.tool_calls`` chunks (a call's id, type and name first, then
its arguments in pieces), ``finish_reason`` "tool_calls" when the model called tools
("stop" for a named function, as OpenAI answers)."""

from __future__ import annotations

from typing import Any

from tandem.cluster.gateway.formatting import ChatFormatter, sse
from tandem.cluster.gateway.tools.parsers import parser_for
from tandem.wire.engine_protocol import Logprobs


class ToolChatFormatter(ChatFormatter):
    def __init__(self, *args: Any, plan: Any, index: int = 0) -> None:
        super().__init__(*args, index=index)
        self._args = (*args,)
        self.plan = plan
        self._parser = parser_for(plan)
        if self._parser is not None:
            self.text_frame = None  # every text goes through the parser (stream_delta)
            self.text_tails = None

    def for_choice(self, index: int) -> ToolChatFormatter:
        return ToolChatFormatter(*self._args, plan=self.plan, index=index)

    def _finish_reason(self, finish_reason: str | None) -> str | None:
        if finish_reason == "stop" and self._parser is not None and self._parser.calls:
            return "stop" if self.plan.mode == "named" else "tool_calls"
        return finish_reason

    def stream_delta(
        self, text: str, logprobs: list[Logprobs] | None, finish_reason: str | None
    ) -> bytes:
        if self._parser is None:
            return super().stream_delta(text, logprobs, finish_reason)
        content, calls = self._parser.feed(text)
        if finish_reason is not None:
            rest, more = self._parser.finish()
            content, calls = content + rest, calls + more
        if not content and not calls and logprobs is None and finish_reason is None:
            return b""
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": self._finish_reason(finish_reason),
        }
        return sse({**self._chunk_head, "choices": [choice]})

    def choice(
        self, text: str, logprobs: list[Logprobs] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        parser = self._parser = parser_for(self.plan)
        if parser is None:
            return super().choice(text, logprobs, finish_reason)
        content, _ = parser.feed(text)
        rest, _ = parser.finish()
        content = (content + rest).strip() if parser.calls else content + rest
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if parser.calls:
            message["tool_calls"] = parser.calls
        return {
            "index": self.index,
            "message": message,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": self._finish_reason(finish_reason),
        }
