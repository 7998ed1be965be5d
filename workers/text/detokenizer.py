"""Incremental detokenization with stop strings, one instance per request.

Token ids arrive a few at a time; clients want text deltas that are never
broken UTF-8 and that concatenate to the decoded output. Two windows:

    ids:  | last emitted tokens | held tokens | new tokens |
          ^0                    ^read_offset
    delta = decode(ids) - decode(ids[:read_offset])          (string diff)

(at the start the "last emitted tokens" are the prompt's last few tokens).

Decoding the new tokens after the last emitted ones, not alone, gives
SentencePiece decoders the left context they need for leading spaces
("▁world" after "Hello" is " world"), and byte-level BPE the bytes of a
character split across tokens (vLLM's approach). While the decoded window ends in U+FFFD (an
incomplete UTF-8 sequence) the new tokens are held back; ``finish()`` emits
whatever is left, replacement characters included. The concatenated deltas
equal ``decode(prompt + output)`` minus ``decode(prompt)`` (for a prompt that
ends on a character boundary), which is ``decode(output)`` for byte-level
BPE or an empty prompt; a SentencePiece continuation keeps the leading
space that ``decode(output)`` alone would strip. Each update decodes only the window, so the cost is
O(new tokens), not O(output).

Stop strings: text that could still be the start of a stop string is held
back until the next tokens decide it. A stop string never starts inside
emitted text, so only the held text needs searching. On a match the delta
ends before the stop string (or after it with
``include_stop_str_in_output``), ``stop_matched`` is set, and the caller
must finish the request; later updates return "".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import tokenizers
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

# Prompt tokens kept as left context for the first output tokens.
_NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, so valid text is decided within 4
# tokens (plus any special tokens between). After this many undecided tokens
# the window is emitted as is (invalid bytes, or a run of skipped special
# tokens), which bounds the cost of one update.
_MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas.

    The common token (one whole-text token after a decided window, no stop
    strings) takes ``update``'s short path: a read of the shared whole-token
    cache and one field set, no list, no decode. Its window (``[token]``, the
    token's text as the prefix) is only written out when the general path
    needs it (``_materialize``). ``keep_text=False``: ``text`` is not kept (a
    streaming caller that never reads it; nothing grows per token).
    """

    # The short path's fields first: one or two cache lines per token.
    __slots__ = (
        "_short",
        "_known_text",
        "_last_id",
        "_pieces",
        "_token_text",
        "_text_cache",
        "_plain",
        "_decode",
        "_stops",
        "_include_stop",
        "_ids",
        "_read_offset",
        "_prefix_text",
        "_pending",
        "stop_matched",
        "finished",
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        keep_text: bool = True,
    ) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self._token_text = token_text = _whole_token_text(tokenizer)
        self._stops = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        self._ids = ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(ids)
        self._pending = ""  # decoded text held back as a possible stop-string start
        # emitted deltas (None: not kept, ``keep_text=False``)
        self._pieces: list[str] | None = [] if keep_text else None
        self._text_cache: str | None = ""
        self.stop_matched: str | None = None
        self.finished = False
        self._known_text: dict[int, str | None] = getattr(token_text, "cache", {})
        # The window after short-path tokens is ``[_last_id]`` (-1: ``_ids`` is current).
        self._last_id = -1
        # ``_prefix_text`` is the decoded window; None: not decoded yet. A window that
        # ends in a whole-text token ends on a character boundary (the token's bytes
        # are complete UTF-8 and begin a character), which is all the short path needs
        # to know of it: a request whose tokens all take it never decodes its prompt.
        self._prefix_text: str | None = None
        plain = token_text is not None and not self._stops
        if not (plain and ids and token_text(ids[-1]) is not None):
            self._prefix_text = self._decode(ids)
        # The short path is open (``_short``): a whole-text token after a decided window,
        # no stop strings to watch (``_plain``). Both False once finished.
        self._plain = plain
        self._short = plain and self._window_is_clean()

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenated deltas)."""
        if self._pieces is None:
            raise AttributeError("this detokenizer does not keep its text (keep_text=False)")
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def update(self, new_token_ids: list[int]) -> str:
        """Add output tokens; return the newly decided text (maybe "")."""
        if self._short and len(new_token_ids) == 1:
            # one whole-text token, nothing held, no stops: the text is the delta
            token_id = new_token_ids[0]
            text = self._known_text.get(token_id)  # a dict read; unknown ids below
            if text is None:
                text = self._token_text(token_id)  # type: ignore[misc]
            if text is not None:
                self._last_id = token_id  # the window restarts at it (``_materialize``)
                if self._pieces is not None:
                    self._pieces.append(text)
                    self._text_cache = None
                return text
        self._materialize()
        if self.finished or self.stop_matched is not None:
            return ""
        try:
            return self._update(new_token_ids)
        finally:
            self._short = self._plain and self._window_is_clean()

    def _materialize(self) -> None:
        """Write out the window the short path left implicit."""
        if self._last_id >= 0:
            token_id, self._last_id = self._last_id, -1
            self._ids = [token_id]
            self._read_offset = 1
            self._prefix_text = self._token_text(token_id)  # type: ignore[misc]
        elif self._prefix_text is None:
            self._prefix_text = self._decode(self._ids)

    def _window_is_clean(self) -> bool:
        """Nothing held back and the window ends on a character boundary."""
        return self._read_offset == len(self._ids) and (
            self._prefix_text is None or not self._prefix_text.endswith(_REPLACEMENT_CHAR)
        )

    def _update(self, new_token_ids: list[int]) -> str:
        # One token at a time: a character split over a chunk boundary then
        # holds back only its own bytes, never the complete text before it.
        new_text = ""
        for token_id in new_token_ids:
            text = None
            if (
                self._token_text is not None
                and self._read_offset == len(self._ids)
                and not self._prefix_text.endswith(_REPLACEMENT_CHAR)
            ):
                text = self._token_text(token_id)
            if text is not None:
                # Nothing held and the token is whole text: it is the delta, and
                # the window restarts at it, as after any decided token.
                self._ids = [token_id]
                self._read_offset = 1
                self._prefix_text = text
                new_text += text
                continue
            self._ids.append(token_id)
            new_text += self._decode_new(force=False)
        return self._emit(new_text, final=False)

    def finish(self) -> str:
        """Flush held text at the end of the request (no more tokens come)."""
        self._plain = self._short = False
        self._materialize()
        if self.finished or self.stop_matched is not None:
            self.finished = True
            return ""
        self.finished = True
        return self._emit(self._decode_new(force=True), final=True)

    def _decode_new(self, force: bool) -> str:
        """Text of the tokens after ``read_offset``, or "" while held back."""
        num_held = len(self._ids) - self._read_offset
        if num_held == 0:
            return ""
        window_text = self._decode(self._ids)
        undecided = len(window_text) <= len(self._prefix_text) or window_text.endswith(
            _REPLACEMENT_CHAR
        )
        if undecided and not force and num_held < _MAX_HELD_TOKENS:
            return ""  # incomplete character, or only skipped special tokens so far
        delta = window_text[len(self._prefix_text) :]
        # The next window starts at the tokens just decided: they begin on a
        # character boundary and give the next tokens their left context.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _emit(self, new_text: str, final: bool) -> str:
        if not self._stops:
            return self._append(new_text)
        pending = self._pending + new_text
        match_start, match = _find_first_stop(pending, self._stops)
        if match is not None:
            self.stop_matched = match
            end = match_start + len(match) if self._include_stop else match_start
            self._pending = ""
            return self._append(pending[:end])
        held = 0 if final else _longest_stop_prefix_suffix(pending, self._stops)
        self._pending = pending[len(pending) - held :] if held else ""
        return self._append(pending[: len(pending) - held])

    def _append(self, delta: str) -> str:
        if delta and self._pieces is not None:
            self._pieces.append(delta)
            self._text_cache = None
        return delta


def _rust_backend(tokenizer: PreTrainedTokenizerBase) -> tokenizers.Tokenizer | None:
    """The ``tokenizers`` object that decodes for ``tokenizer``, if it does not override
    decoding in Python (then the backend gives the same text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        isinstance(backend, tokenizers.Tokenizer)
        and type(tokenizer)._decode is TokenizersBackend._decode
    ):
        return backend
    return None


def _make_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """``ids -> text`` without clean-up of spaces (it would break the diff).

    For Rust-backed tokenizers that do not override decoding, calls the
    ``tokenizers`` backend directly: same text, a quarter of the overhead.
    """
    backend = _rust_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


_WHOLE_TOKEN_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _whole_token_text(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], str | None] | None:
    """``token_id -> text`` for tokens whose text never depends on their neighbours,
    else None; None for the whole tokenizer when that cannot be known.

    Byte-level BPE decoding (GPT-2, Llama 3, Qwen, ``tiny``) maps each token to bytes
    and decodes their concatenation, so after text that ends on a character boundary
    a token whose own bytes are complete UTF-8 adds exactly its own text. Added
    tokens (special or not) are left to the window. One cache per tokenizer, shared
    by every request: most output tokens then cost a dict lookup, not two decodes.
    """
    backend = _rust_backend(tokenizer)
    if backend is None or not isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
        return None
    try:
        return _WHOLE_TOKEN_TEXT[tokenizer]
    except KeyError:
        pass
    added = set(tokenizer.added_tokens_decoder)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    cache: dict[int, str | None] = {}

    def token_text(token_id: int) -> str | None:
        try:
            return cache[token_id]
        except KeyError:
            pass
        text = None
        if token_id not in added and 0 <= token_id < vocab_size:
            decoded = backend.decode([token_id], skip_special_tokens=False)
            if decoded and _REPLACEMENT_CHAR not in decoded:
                text = decoded
        cache[token_id] = text
        return text

    token_text.cache = cache  # type: ignore[attr-defined]  # read directly per token
    _WHOLE_TOKEN_TEXT[tokenizer] = token_text
    return token_text


def _find_first_stop(text: str, stops: list[str]) -> tuple[int, str | None]:
    """Earliest stop-string occurrence in ``text``: (start, stop) or (-1, None).

    At equal starts the stop listed first wins.
    """
    best_start, best = -1, None
    for stop in stops:
        start = text.find(stop)
        if start != -1 and (best is None or start < best_start):
            best_start, best = start, stop
    return best_start, best


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
