"""Sampling fields of a request that need the tokenizer or the server's caps,
checked with the field named (400): logit bias keys and bad words turned
into token ids, logprob counts under ``--max-logprobs``. (Ranges that need
neither, like the penalties', are checked in ``protocol.validate_common``.)

    logit_bias                            {"token id": value in [-100, 100]}
    bad_words                             non-empty strings
    logprobs / top_logprobs               [0, max_logprobs]
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from cluster.protocol import ProtocolError
from scheduler.messages import SamplingParams


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
