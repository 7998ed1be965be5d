"""TokenizerPool: the work runs off the event loop's thread; the pre-check
refuses only texts that cannot fit."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.cluster.gateway.edge.tokenizer_pool import TokenizerPool, chat_text_len
from tandem.cluster.gateway.protocol import ProtocolError
from tandem.workers.checkpoints.tiny import build_tokenizer
from tandem.workers.text.tokenizer import apply_chat_template, encode_prompt


class RecordingTokenizer:
    """Delegates to tiny's tokenizer and records the thread of every encode."""

    def __init__(self) -> None:
        self.inner = build_tokenizer()
        self.threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.inner.encode(*args, **kwargs)


def test_encode_and_chat_run_on_pool_threads_and_match():
    tokenizer = RecordingTokenizer()
    pool = TokenizerPool(tokenizer, num_workers=2)
    messages = [{"role": "user", "content": "hello"}]

    async def run():
        return await pool.encode("a" * 1000), await pool.chat(messages, True)

    try:
        ids, chat_ids = asyncio.run(run())
    finally:
        pool.close()
    assert ids == encode_prompt(tokenizer.inner, "a" * 1000)
    assert chat_ids == apply_chat_template(tokenizer.inner, messages)
    assert len(tokenizer.threads) == 2
    assert all(name.startswith("tokenize") for name in tokenizer.threads)


def test_chat_errors_propagate_as_value_error():
    pool = TokenizerPool(build_tokenizer(), num_workers=1)
    try:
        with pytest.raises(ValueError, match=r"messages\[0\].role"):
            asyncio.run(pool.chat([{"content": "x"}], True))
    finally:
        pool.close()


def test_length_pre_check_is_a_lower_bound():
    tokenizer = build_tokenizer()
    pool = TokenizerPool(tokenizer, num_workers=1)
    try:
        longest = max(len(t) for t in tokenizer.get_vocab())
        assert pool.max_chars_per_token == longest  # no normalizer: no slack
        # a text of that many characters per allowed token may still fit: not refused
        pool.check_text_len(4096 * longest - 1, 4096, "prompt")
        with pytest.raises(ProtocolError) as info:
            pool.check_text_len(4096 * longest, 4096, "prompt")
        assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    finally:
        pool.close()


def test_chat_text_len_counts_text_parts_and_ignores_garbage():
    messages = [
        {"role": "user", "content": "abc"},
        {"role": "user", "content": [{"type": "text", "text": "de"}, {"type": "image"}]},
        "not a message",
        {"role": "user", "content": 5},
    ]
    assert chat_text_len(messages) == 5
    assert chat_text_len("nope") == 0
