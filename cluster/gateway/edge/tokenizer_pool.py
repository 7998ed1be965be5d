"""Prompt tokenization and chat templating off the event loop.

A 100k-token prompt takes ~0.1-1 s to encode; on the event loop that time is
added to every other request's latency. The work runs on a small thread pool
instead: the Rust tokenizer releases the GIL while it encodes (measured: a
600k-token encode on a worker thread leaves the loop thread at most ~20 ms
without the GIL, while the token list is built), so threads suffice and a
process pool (pickling the prompt and the ids both ways) is not needed.

Before any tokenizer work, ``check_text_len`` refuses a text that cannot fit
in the context whatever its tokens: no token is longer than the longest
vocabulary entry, so ``len(text) / longest`` is a lower bound on the token
count (times a slack factor when the tokenizer normalizes text, since a
normalizer may shorten it).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tandem.cluster.gateway.protocol import ProtocolError
from tandem.workers.text.tokenizer import apply_chat_template, encode_prompt

# A normalizer (NFC, accent stripping) can shorten text; Unicode composition
# shortens it by at most ~3x (Hangul jamo), so 4 keeps the bound safe.
_NORMALIZER_SLACK = 4

T = TypeVar("T")


class TokenizerPool:
    """``encode``/``chat`` run on ``num_workers`` threads; both are coroutines
    for the event loop. ``max_model_len`` is read at each call (a backend
    learns it when its engines report ready)."""

    def __init__(self, tokenizer: Any, num_workers: int) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="tokenize")
        vocab = tokenizer.get_vocab()
        longest = max((len(token) for token in vocab), default=1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        slack = 1 if backend is not None and backend.normalizer is None else _NORMALIZER_SLACK
        self.max_chars_per_token = max(longest, 1) * slack

    def check_text_len(self, num_chars: int, max_model_len: int, param: str) -> None:
        """Refuse (400) ``num_chars`` of prompt text that is sure to exceed
        ``max_model_len`` tokens, without tokenizing it."""
        min_num_tokens = num_chars // self.max_chars_per_token
        if max_model_len and min_num_tokens >= max_model_len:
            raise ProtocolError(
                f"The prompt has at least {min_num_tokens} tokens ({num_chars} characters); "
                f"the model's context length is {max_model_len}.",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, encode_prompt, self.tokenizer, text)

    async def chat(
        self, messages: list[Any], add_generation_prompt: bool, tools: list[Any] | None = None
    ) -> list[int]:
        """``apply_chat_template`` on a worker (``tools``: rendered by templates that
        know them); its ``ValueError`` propagates."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor,
            functools.partial(apply_chat_template, tools=tools),
            self.tokenizer,
            messages,
            add_generation_prompt,
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker (other tokenizer work: /tokenize, /detokenize)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def chat_text_len(messages: Any) -> int:
    """Characters of message content (text parts included); 0 for anything
    malformed (the template's own validation reports that)."""
    total = 0
    if not isinstance(messages, list):
        return 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += len(part["text"])
    return total
