"""The OpenAI wire format, requests side: request schemas, their validation,
and the error envelope.

Requests are decoded with msgspec (strict types: ``"5"`` is not an int,
``true`` is not a number); every problem becomes a ``ProtocolError`` that
the gateway answers with the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}`` and a 4xx status.
Response bodies and SSE chunks are ``formatting.py``'s. Nothing here knows
about tokenizers' internals or the backend.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import msgspec

from tandem.scheduler.fork import MAX_N
from tandem.wire.engine_protocol import SamplingParams


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
    # output constraints (cluster/gateway/edge/structured.py): OpenAI's, vLLM's, vLLM's older
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None  # a JSON schema, as an object or its JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, ignored: the engines pick
    guided_whitespace_pattern: str | None = None  # accepted, ignored

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
    # tool calling (cluster/gateway/tools/)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

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
