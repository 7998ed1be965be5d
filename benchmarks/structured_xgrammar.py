"""xgrammar behind the grammar backend interface of ``workers/structured/backend.py``, for
``benchmarks/structured_outputs.py``'s comparison only (xgrammar imports torch, so the engine,
whose gateway validates specs torch-free, runs llguidance)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tandem.wire.engine_protocol import StructuredOutputsParams
from tandem.workers.structured import spec as specs
from tandem.workers.structured.backend import Matcher


class _XGrammarMatcher:
    __slots__ = ("_m", "_torch")

    def __init__(self, matcher: Any) -> None:
        import torch

        self._m = matcher
        self._torch = torch

    def advance(self, tokens: list[int]) -> int:
        for num, token in enumerate(tokens):
            if not self._m.accept_token(token):
                return num
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._m.fill_next_token_bitmask(self._torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def error(self) -> str | None:
        return None


class XGrammarBackend:
    """xgrammar (imports torch): for the benchmark's comparison."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        # its own cache off: the compile pool's cache is the one measured and used
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        c, kind = self._compiler, spec.kind
        if kind == "json":
            return c.compile_json_schema(spec.text, any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema(specs.ANY_JSON_OBJECT, any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(spec.text)
        if kind == "choice":
            choices = specs.choice_list(spec.text)
            return c.compile_grammar("root ::= " + " | ".join(self._quote(x) for x in choices))
        return c.compile_grammar(spec.text)

    @staticmethod
    def _quote(text: str) -> str:
        return json.dumps(text)

    def matcher(self, compiled: Any) -> Matcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled))
