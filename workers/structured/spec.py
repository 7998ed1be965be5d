"""A ``StructuredOutputsParams`` as a grammar llguidance takes, and its validation.

Torch-free and tokenizer-free: the gateway validates every spec with this module before
any engine work (a bad spec is a 400 naming its field), and the engines' compile pool
(``workers/structured/manager.py``) builds its grammars with the same function, so the
gateway accepts exactly what an engine can compile.

JSON schemas compile with compact separators (``", "`` and ``": "``, no free
whitespace): a small model otherwise can loop on whitespace until ``max_tokens``.
"""

from __future__ import annotations

import json

import llguidance

from tandem.wire.engine_protocol import StructuredOutputsParams

# JSON: fixed separators instead of any whitespace (module docstring)
_JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``spec``. Raises ``ValueError`` on a malformed spec
    (what ``check`` reports in full)."""
    kind, text = spec.kind, spec.text
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            ANY_JSON_OBJECT, defaults=_JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        choices = choice_list(text)
        lark = "start: " + " | ".join(json.dumps(c) for c in choices)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if kind == "grammar":
        return llguidance.grammar_from("grammar", text)  # Lark, or GBNF/EBNF converted
    raise ValueError(f"unknown structured output kind {kind!r}")


def choice_list(text: str) -> list[str]:
    """The choices of a ``choice`` spec (a JSON list of non-empty strings)."""
    try:
        choices = json.loads(text)
    except ValueError:
        raise ValueError("choice must be a JSON list of strings") from None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a list of strings")
    if not choices:
        raise ValueError("choice must not be empty")
    if not all(choices):
        raise ValueError("choice must not contain an empty string")
    return choices


def check(spec: StructuredOutputsParams) -> str:
    """Validate ``spec``; returns its grammar. Raises ``ValueError`` with llguidance's
    reason (an invalid schema, regex or grammar; an empty choice)."""
    spec.validate()
    try:
        grammar = grammar_text(spec)
    except ValueError as exc:
        raise ValueError(f"invalid {spec.kind}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {spec.kind}: {error.strip()}")
    return grammar
