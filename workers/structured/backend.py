"""The grammar backend behind one small interface, so the engine does not depend on a
grammar library's API:

    backend  = make_backend("llguidance", hf_tokenizer, vocab_size, eos_token_ids)
    compiled = backend.compile(spec)          # slow: the compile pool's threads
    matcher  = backend.matcher(compiled)      # cheap: one per request
    matcher.fill_bitmask(bitmask, row)        # int32 [rows, ceil(V / 32)], bit set = allowed
    matcher.advance([t0, t1, ...])            # -> how many it accepted (stops at a rejected one)
    matcher.rollback(2)                       # undo the last two accepted tokens
    matcher.is_terminated()

``advance`` and ``rollback`` take token lists so that speculative decoding can move a
matcher through draft tokens and roll the rejected ones back.

llguidance is what the engine runs (docs/architecture.md, "Structured outputs", says why:
its Python package does not import torch, so the gateway validates with the very library
the engines compile with, and it compiles far faster). xgrammar, measured against it, has
the same interface in ``benchmarks/structured_xgrammar.py`` (benchmark only; it imports torch).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from tandem.wire.engine_protocol import StructuredOutputsParams
from tandem.workers.structured import spec as specs

BACKENDS = ("llguidance",)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Matcher(Protocol):
    def advance(self, tokens: list[int]) -> int: ...
    def rollback(self, num_tokens: int) -> None: ...
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None: ...
    def is_terminated(self) -> bool: ...
    def error(self) -> str | None: ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: StructuredOutputsParams) -> Any: ...
    def matcher(self, compiled: Any) -> Matcher: ...


class _LLGuidanceMatcher:
    """llguidance does not consume an EOS once its grammar has stopped (no token is left to
    match), yet that EOS is the request's legitimate last token: ``advance`` accepts it and
    remembers it (``_end``), and ``rollback`` counts it, so a speculative walk
    ``advance(drafts)`` / ``rollback(n)`` always returns to the state it started from."""

    __slots__ = ("_m", "_eos", "_end")

    def __init__(self, matcher: Any, eos_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._eos = eos_token_ids
        self._end = False  # an EOS accepted after the grammar stopped (not in llguidance)

    def advance(self, tokens: list[int]) -> int:
        if self._end:
            return 0  # nothing follows the final EOS
        num = max(0, self._m.try_consume_tokens(tokens))
        if num < len(tokens) and tokens[num] in self._eos and self._m.is_stopped():
            num += 1  # EOS after the grammar ended: accepted (and the last one)
            self._end = True
        return num

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._end:
            self._end = False
            num_tokens -= 1
        if num_tokens and not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll the matcher back by {num_tokens} tokens")

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceBackend:
    """llguidance: ``compile`` builds a matcher (the lexer and parser tables are built
    then); each request's matcher is a deep copy of it, cheap."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )

    def compile(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, specs.grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind}: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled: Any) -> Matcher:
        return _LLGuidanceMatcher(compiled.deep_copy(), self._eos)


def make_backend(
    name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> GrammarBackend:
    if name == "llguidance":
        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(
        f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, got {name!r}"
    )
