"""The OpenAI wire format, responses side: JSON bodies, SSE chunks and the
usage object of completions and chat completions.

One formatter per choice of a response (``CompletionFormatter``,
``ChatFormatter``) renders its whole-response body, its stream chunks and
its logprobs; the common stream chunk (text only) is a fixed byte frame.
Requests and errors are ``protocol.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from tandem.wire.engine_protocol import Logprobs

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf; clients expect a number

encode_json = msgspec.json.encode


def sse(payload: Any) -> bytes:
    return b"data: " + encode_json(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class TextTails:
    """``text -> encode_json(text) + suffix``: the common text chunk's end (``text_frame``'s
    suffix after the text's JSON), one table per chunk kind shared by every response.

    The SSE writer builds a text chunk as ``prefix + tail``: one concatenation, no
    encoding, for a text seen before (most streamed tokens are a vocabulary entry's
    text, the same ``str`` each time). The table is emptied when it reaches
    ``_MAX_TEXT_TAILS`` entries, so it holds what recent streams used, never grows
    without bound.
    """

    __slots__ = ("suffix", "table")

    def __init__(self, suffix: bytes) -> None:
        self.suffix = suffix
        self.table: dict[str, bytes] = {}

    def make(self, text: str) -> bytes:
        """The tail of ``text``, encoded and kept (``table.get`` first)."""
        tail = encode_json(text) + self.suffix
        table = self.table
        if len(table) >= _MAX_TEXT_TAILS:
            table.clear()
        table[text] = tail
        return tail


_MAX_TEXT_TAILS = 1 << 15
_COMPLETION_SUFFIX = b',"logprobs":null,"finish_reason":null}]}\n\n'
_CHAT_SUFFIX = b'},"logprobs":null,"finish_reason":null}]}\n\n'
_COMPLETION_TAILS = TextTails(_COMPLETION_SUFFIX)
_CHAT_TAILS = TextTails(_CHAT_SUFFIX)


def usage(
    num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the
    prefix cache instead of computed (see ``request_run.RequestRun`` for P/D)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def _lp(value: float) -> float:
    return value if value > _LOGPROB_FLOOR else _LOGPROB_FLOOR


class _ChoiceBodies:
    """What both formatters share: whole-response bodies and per-choice copies.

    A formatter renders one choice (``index``); ``for_choice`` makes the
    formatter of another choice of the same response (n > 1)."""

    _args: tuple[Any, ...]  # the constructor's arguments, index aside
    # The common text chunk (text only, not the last): ``prefix + encode_json(text) +
    # suffix`` is ``stream_delta(text, None, None)``, built by the SSE writer itself.
    # None: every text must go through ``stream_delta`` (tool calls parse it).
    text_frame: tuple[bytes, bytes] | None = None
    # ``text_frame``'s suffix after the text's JSON, shared (None with no ``text_frame``)
    text_tails: TextTails | None = None
    prompt_logprobs_in_choice = False  # vLLM: in each choice (completions) or at the top (chat)
    _head: dict[str, Any]  # id, object, created, model of the whole response

    def choice(
        self, text: str, logprobs: list[Logprobs] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def response(
        self,
        text: str,
        logprobs: list[Logprobs] | None,
        finish_reason: str,
        usage_body: dict[str, Any],
    ) -> bytes:
        return self.response_choices([self.choice(text, logprobs, finish_reason)], usage_body)

    def response_choices(
        self,
        choices: list[dict[str, Any]],
        usage_body: dict[str, Any],
        prompt_logprobs: list[Any] | None = None,
    ) -> bytes:
        """The body of a response with several choices (``choice`` of each formatter).
        ``prompt_logprobs`` (vLLM's): in each choice (completions) or at the top (chat)."""
        extra: dict[str, Any] = {}
        if prompt_logprobs is not None:
            if self.prompt_logprobs_in_choice:
                choices = [{**c, "prompt_logprobs": prompt_logprobs} for c in choices]
            else:
                extra["prompt_logprobs"] = prompt_logprobs
        return encode_json({**self._head, "choices": choices, "usage": usage_body, **extra})

    def for_choice(self, index: int) -> Any:
        """A formatter of the same response for choice ``index``."""
        return type(self)(*self._args, index=index)


class CompletionFormatter(_ChoiceBodies):
    """Bodies and SSE chunks of one ``/v1/completions`` response."""

    object_name = "text_completion"
    prompt_logprobs_in_choice = True

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        num_logprobs: int | None,
        token_text: Callable[[int], str],
        index: int = 0,
    ) -> None:
        self._args = (request_id, model, created, num_logprobs, token_text)
        self.request_id = request_id
        self.model = model
        self.created = created
        self.num_logprobs = num_logprobs
        self.index = index  # the choice (n > 1)
        self._token_text = token_text
        self._num_chars = 0  # text_offset of the next token
        head = {"id": request_id, "object": self.object_name, "created": created, "model": model}
        # Fast path for the common chunk (text only, not last): a fixed frame.
        self._delta_prefix = (
            b"data: " + encode_json(head)[:-1] + b',"choices":[{"index":%d,"text":' % index
        )
        self._delta_suffix = _COMPLETION_SUFFIX
        self.text_frame = (self._delta_prefix, self._delta_suffix)
        self.text_tails = _COMPLETION_TAILS
        self._head = head

    def stream_start(self) -> list[bytes]:
        return []

    def stream_delta(
        self, text: str, logprobs: list[Logprobs] | None, finish_reason: str | None
    ) -> bytes:
        if logprobs is None and finish_reason is None:
            return self._delta_prefix + encode_json(text) + self._delta_suffix
        return sse({**self._head, "choices": [self.choice(text, logprobs, finish_reason)]})

    def stream_usage(self, usage_body: dict[str, Any]) -> bytes:
        return sse({**self._head, "choices": [], "usage": usage_body})

    def choice(
        self, text: str, logprobs: list[Logprobs] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": text,
            "logprobs": self._logprobs(logprobs) if self.num_logprobs is not None else None,
            "finish_reason": finish_reason,
        }

    def _logprobs(self, entries: list[Logprobs] | None) -> dict[str, list[Any]]:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for entry in entries or ():
            token = self._token_text(entry.token_id)
            tokens.append(token)
            if entry.logprob != entry.logprob:  # NaN: an echoed first prompt token
                token_logprobs.append(None)
                top_logprobs.append(None)
                text_offset.append(self._num_chars)
                self._num_chars += len(token)
                continue
            token_logprobs.append(_lp(entry.logprob))
            top = {token: _lp(entry.logprob)}
            for top_id, top_lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False):
                top.setdefault(self._token_text(top_id), _lp(top_lp))
            top_logprobs.append(top)
            text_offset.append(self._num_chars)
            self._num_chars += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


class ChatFormatter(_ChoiceBodies):
    """Bodies and SSE chunks of one ``/v1/chat/completions`` response."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        num_logprobs: int | None,
        token_text: Callable[[int], str],
        index: int = 0,
    ) -> None:
        self._args = (request_id, model, created, num_logprobs, token_text)
        self.request_id = request_id
        self.index = index  # the choice (n > 1)
        self.num_logprobs = num_logprobs
        self._token_text = token_text
        self._chunk_head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        self._head = {**self._chunk_head, "object": "chat.completion"}
        self._delta_prefix = (
            b"data: "
            + encode_json(self._chunk_head)[:-1]
            + b',"choices":[{"index":%d,"delta":{"content":' % index
        )
        self._delta_suffix = _CHAT_SUFFIX
        self.text_frame = (self._delta_prefix, self._delta_suffix)
        self.text_tails = _CHAT_TAILS

    def stream_start(self) -> list[bytes]:
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [sse({**self._chunk_head, "choices": [choice]})]

    def stream_delta(
        self, text: str, logprobs: list[Logprobs] | None, finish_reason: str | None
    ) -> bytes:
        if logprobs is None and finish_reason is None:
            return self._delta_prefix + encode_json(text) + self._delta_suffix
        choice = {
            "index": self.index,
            "delta": {"content": text} if text else {},
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        return sse({**self._chunk_head, "choices": [choice]})

    def stream_usage(self, usage_body: dict[str, Any]) -> bytes:
        return sse({**self._chunk_head, "choices": [], "usage": usage_body})

    def choice(
        self, text: str, logprobs: list[Logprobs] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        return {
            "index": self.index,
            "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, entries: list[Logprobs] | None) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        content = []
        for entry in entries or ():
            top = [
                self._entry(top_id, top_lp)
                for top_id, top_lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
            ][: self.num_logprobs]
            content.append({**self._entry(entry.token_id, entry.logprob), "top_logprobs": top})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token_text(token_id)
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}
