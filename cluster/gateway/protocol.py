"""The OpenAI wire format: request schemas, their validation, response bodies.

Requests are decoded with msgspec (strict types: ``"5"`` is not an int,
``true`` is not a number); every problem becomes a ``ProtocolError`` that
the gateway answers with the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}`` and a 4xx status.
Nothing here knows about tokenizers' internals or the backend.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from scheduler.fork import MAX_N
from wire.engine_protocol import Logprobs, SamplingParams

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf; clients expect a number


class ProtocolError(Exception):
    """A request the gateway refuses; carries the HTTP status and envelope."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests --------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _CommonRequest(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions (plus vLLM extras)."""

    model: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = 1
    user: str | None = None
    # checked and converted by cluster/gateway/edge/sampling.py
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    min_p: float | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    top_k: int | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # Prefix-cache tenant key: requests share cached KV only with equal salts.
    cache_salt: str | None = None
    # vLLM's scheduling priority: lower value first (--scheduling-policy priority)
    priority: int | None = 0

    def __post_init__(self) -> None:
        # Clients send explicit nulls for "not set"; give those fields their defaults.
        for name, default in self._NULL_DEFAULTS:
            if getattr(self, name) is None:
                setattr(self, name, default)

    _NULL_DEFAULTS: ClassVar[tuple[tuple[str, Any], ...]] = (
        ("stream", False),
        ("n", 1),
        ("min_tokens", 0),
        ("ignore_eos", False),
        ("skip_special_tokens", True),
        ("include_stop_str_in_output", False),
        ("priority", 0),
    )


class CompletionRequest(_CommonRequest, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    _NULL_DEFAULTS = (*_CommonRequest._NULL_DEFAULTS, ("echo", False))


class ChatCompletionRequest(_CommonRequest, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    _NULL_DEFAULTS = (
        *_CommonRequest._NULL_DEFAULTS,
        ("logprobs", False),
        ("add_generation_prompt", True),
    )


_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")


def decode_request(body: bytes, request_type: type[Any]) -> Any:
    """Decode and type-check a JSON body; ``ProtocolError`` on any problem."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path_match = _AT_PATH.search(text)
        param = path_match.group(1) if path_match else None
        missing = _MISSING_FIELD.search(text)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        raise ProtocolError(f"Invalid request: {text}", param=param or None) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"Invalid JSON body: {exc}") from None


def validate_common(req: _CommonRequest, served_model: str) -> None:
    """Checks that need no tokenizer. Raises ``ProtocolError``."""
    if req.model is not None and req.model != served_model:
        raise ProtocolError(
            f"The model `{req.model}` does not exist; this server serves `{served_model}`.",
            param="model",
            code="model_not_found",
        )
    if not 1 <= req.n <= MAX_N:
        raise ProtocolError(f"n must be in [1, {MAX_N}], got {req.n}.", param="n")
    if req.stream_options is not None and not req.stream:
        raise ProtocolError(
            "stream_options is only allowed with stream=true.", param="stream_options"
        )
    if req.temperature is not None and not (
        math.isfinite(req.temperature) and req.temperature >= 0
    ):
        raise ProtocolError(
            f"temperature must be >= 0, got {req.temperature}.", param="temperature"
        )
    if req.top_p is not None and not (0.0 < req.top_p <= 1.0):
        raise ProtocolError(f"top_p must be in (0, 1], got {req.top_p}.", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise ProtocolError(f"top_k must be -1, 0 or >= 1, got {req.top_k}.", param="top_k")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise ProtocolError("seed must fit in 64 bits.", param="seed")
    if req.min_tokens < 0:
        raise ProtocolError(f"min_tokens must be >= 0, got {req.min_tokens}.", param="min_tokens")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise ProtocolError(f"{name} must be in [-2, 2], got {value}.", param=name)
    rep = req.repetition_penalty
    if rep is not None and not (math.isfinite(rep) and rep > 0):
        raise ProtocolError(
            f"repetition_penalty must be > 0, got {rep}.", param="repetition_penalty"
        )
    if req.min_p is not None and not (math.isfinite(req.min_p) and 0.0 <= req.min_p <= 1.0):
        raise ProtocolError(f"min_p must be in [0, 1], got {req.min_p}.", param="min_p")
    if req.prompt_logprobs is not None and req.stream:
        raise ProtocolError(
            "prompt_logprobs is not available with stream=true.", param="prompt_logprobs"
        )
    for stop in stop_strings(req):
        if not stop:
            raise ProtocolError("stop strings must be non-empty.", param="stop")
    if not -(2**63) <= req.priority < 2**63:
        raise ProtocolError("priority must fit in 64 bits.", param="priority")
    if req.cache_salt is not None and not req.cache_salt:
        raise ProtocolError("cache_salt must be a non-empty string.", param="cache_salt")


def check_max_tokens(max_tokens: int | None, param: str) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise ProtocolError(f"{param} must be at least 1, got {max_tokens}.", param=param)


def stop_strings(req: _CommonRequest) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt: text or token ids. Refuses unsupported fields."""
    if req.suffix:
        raise ProtocolError("suffix is not supported.", param="suffix")
    if req.best_of not in (None, 1):
        raise ProtocolError(
            "best_of is not supported (vLLM v1 removed it); use n for several choices.",
            param="best_of",
        )
    check_max_tokens(req.max_tokens, "max_tokens")
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and all(type(t) is int for t in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]  # type: ignore[return-value]
    if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise ProtocolError("Only one prompt per request is supported.", param="prompt")
    raise ProtocolError(
        "prompt must be a string, a list of token ids, or a list with one of those.",
        param="prompt",
    )


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """Number of top logprobs to return per token, or None for no logprobs."""
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise ProtocolError("top_logprobs requires logprobs=true.", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def check_chat_fields(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise ProtocolError("tools are not supported.", param="tools")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise ProtocolError(
            "Only response_format type 'text' is supported.", param="response_format"
        )
    check_max_tokens(req.max_tokens, "max_tokens")
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens")


def sampling_params(
    req: _CommonRequest, *, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=0 if req.top_k is None else req.top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        prompt_logprobs=req.prompt_logprobs,
    )
    try:
        params.validate()
    except ValueError as exc:
        # validate() messages start with the field's name
        field = str(exc).split(" ", 1)[0]
        param = field if field in SamplingParams.__struct_fields__ else None
        raise ProtocolError(str(exc), param=param) from None
    return params


# ---- responses -------------------------------------------------------------------

encode_json = msgspec.json.encode


def sse(payload: Any) -> bytes:
    return b"data: " + encode_json(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(
    num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the
    prefix cache instead of computed (see Gateway.run for P/D)."""
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
        self._delta_suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'
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
        self._delta_suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'

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
