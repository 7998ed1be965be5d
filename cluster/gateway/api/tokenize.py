"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

    /tokenize    {"prompt": str, "add_special_tokens": true}            completion form
                 {"messages": [...], "add_generation_prompt": true}     chat form
              -> {"count": n, "max_model_len": L, "tokens": [...], "token_strs": null | [...]}
    /detokenize  {"tokens": [...]} -> {"prompt": str}

The chat form gives exactly the prompt tokens ``/v1/chat/completions`` would
run (same template, same encoding); the completion form with
``add_special_tokens`` true those of ``/v1/completions``. Bodies are read
under the gateway's size limit, tokenization runs on the tokenizer pool
after the same length pre-check as generation, and bad input is a 400 in
the OpenAI envelope. Guarded by the API key like ``/v1/*``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from tandem.cluster.gateway import protocol
from tandem.cluster.gateway.edge.limits import read_body
from tandem.cluster.gateway.edge.tokenizer_pool import chat_text_len
from tandem.cluster.gateway.protocol import ProtocolError
from tandem.workers.text.tokenizer import apply_chat_template


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    messages: list[dict[str, Any]]
    model: str | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # vLLM accepts these; only their defaults are supported here (400 otherwise)
    continue_final_message: bool = False
    add_special_tokens: bool = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _decode(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def _json(payload: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


def add_tokenize_routes(app: FastAPI, gateway: Any, check_api_key: Callable) -> None:
    """Register both routes on ``app``; ``gateway`` is the
    ``cluster.gateway.generation.Gateway``."""
    pool = gateway.tokenizer_pool
    tokenizer = gateway.tokenizer

    async def tokenize(request: Request) -> Response:
        check_api_key(request)
        body = await read_body(request, gateway.limits.max_request_body_bytes)
        try:
            is_chat = b'"messages"' in body and "messages" in msgspec.json.decode(body)
        except (msgspec.DecodeError, TypeError):
            is_chat = False  # decode_request reports the problem
        max_model_len = gateway.backend.max_model_len
        if is_chat:
            req = protocol.decode_request(body, TokenizeChatRequest)
            gateway.models.resolve(req.model)
            for name in ("continue_final_message", "add_special_tokens"):
                if getattr(req, name):
                    raise ProtocolError(f"{name}=true is not supported.", param=name)
            pool.check_text_len(chat_text_len(req.messages), max_model_len, "messages")
            try:
                tokens = await pool.run(
                    apply_chat_template, tokenizer, req.messages, req.add_generation_prompt
                )
            except ValueError as exc:
                raise ProtocolError(str(exc), param="messages") from None
        else:
            req = protocol.decode_request(body, TokenizeCompletionRequest)
            gateway.models.resolve(req.model)
            pool.check_text_len(len(req.prompt), max_model_len, "prompt")
            tokens = await pool.run(_encode, tokenizer, req.prompt, req.add_special_tokens)
        token_strs = tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return _json(TokenizeResponse(len(tokens), max_model_len, tokens, token_strs))

    async def detokenize(request: Request) -> Response:
        check_api_key(request)
        body = await read_body(request, gateway.limits.max_request_body_bytes)
        req = protocol.decode_request(body, DetokenizeRequest)
        gateway.models.resolve(req.model)
        gateway._check_token_ids(req.tokens, param="tokens")
        return _json(DetokenizeResponse(await pool.run(_decode, tokenizer, req.tokens)))

    app.add_route("/tokenize", tokenize, methods=["POST"])
    app.add_route("/detokenize", detokenize, methods=["POST"])
