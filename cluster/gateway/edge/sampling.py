"""Sampling fields of a request that need the tokenizer or the server's caps,
checked with the field named (400): logit bias keys and bad words turned
into token ids, logprob counts under ``--max-logprobs``. (Ranges that need
neither, like the penalties', are checked in ``protocol.validate_common``.)

    logit_bias                            {"token id": value in [-100, 100]}
    bad_words                             non-empty strings
    logprobs / top_logprobs / prompt_logprobs   [0, max_logprobs]

and the response pieces of ``prompt_logprobs`` (vLLM's shape) and ``echo``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec

from tandem.cluster.gateway.protocol import ProtocolError
from tandem.wire.engine_protocol import Logprobs, SamplingParams


def check_num_logprobs(value: int | None, param: str, max_logprobs: int) -> None:
    if value is not None and not 0 <= value <= max_logprobs:
        raise ProtocolError(
            f"{param} must be in [0, {max_logprobs}] (--max-logprobs), got {value}.", param=param
        )


def logit_bias_ids(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """``{"id": bias}`` -> ``{id: bias}``; keys must be token ids of the vocabulary."""
    if not logit_bias:
        return None
    result = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < vocab_size:
            raise ProtocolError(
                f"logit_bias key {key!r} is not a token id in [0, {vocab_size}).",
                param="logit_bias",
            )
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise ProtocolError(
                f"logit_bias value for {key} must be in [-100, 100], got {value}.",
                param="logit_bias",
            )
        result[token_id] = float(value)
    return result


def bad_words_ids(tokenizer: Any, bad_words: list[str] | None) -> list[list[int]]:
    """Token sequences of each bad word as it would appear at the start of
    the output and after a space (both are banned), without duplicates."""
    sequences: list[list[int]] = []
    for word in bad_words or ():
        if not word.strip():
            raise ProtocolError("bad_words must be non-empty strings.", param="bad_words")
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def with_token_fields(
    params: SamplingParams, req: Any, tokenizer: Any, vocab_size: int
) -> SamplingParams:
    """``params`` plus the fields that need the tokenizer or the vocabulary."""
    bias = logit_bias_ids(req.logit_bias, vocab_size)
    bad_words = bad_words_ids(tokenizer, req.bad_words)
    if bias is None and not bad_words:
        return params
    return msgspec.structs.replace(params, logit_bias=bias, bad_words_token_ids=bad_words)


def prompt_logprobs_body(
    entries: list[Logprobs] | None, token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then per
    token ``{"id": {"logprob", "rank", "decoded_token"}}`` for the token itself
    and its top alternatives (ranked 1, 2, ...)."""
    body: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries or ():
        tops = zip(entry.top_token_ids, entry.top_logprobs, strict=False)
        position = {
            str(token_id): _logprob_entry(logprob, rank, token_text(token_id))
            for rank, (token_id, logprob) in enumerate(tops, 1)
        }
        position[str(entry.token_id)] = _logprob_entry(
            entry.logprob, entry.rank, token_text(entry.token_id)
        )
        body.append(position)
    return body


def _logprob_entry(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": text}


def echo_logprobs(prompt_ids: list[int], entries: list[Logprobs] | None) -> list[Logprobs]:
    """The echoed prompt's entries for a completion's ``logprobs``: the first
    token has none (NaN, formatted as null), the others are the prompt logprobs."""
    first = Logprobs(token_id=prompt_ids[0], logprob=math.nan)
    return [first, *(entries or ())]
