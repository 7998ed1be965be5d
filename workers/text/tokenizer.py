"""Tokenizer loading, prompt encoding and chat templates (transformers).

Chat prompts are rendered to text by the tokenizer's Jinja chat template
and then encoded with ``add_special_tokens=False``: the template already
writes BOS and role markers, so encoding must not add a second BOS.

Tokenizers without a chat template fall back to ``FALLBACK_CHAT_TEMPLATE``
(unless ``allow_fallback=False``), one block per message:

    <bos><|user|>
    Hello!
    <|assistant|>
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

FALLBACK_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Tokenizer from a local directory (or an already cached hub id).

    Never touches the network: ``local_files_only=True``; no remote code.
    """
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    drop_whole_text_cache(tokenizer)
    return tokenizer


def drop_whole_text_cache(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Turn off the BPE word cache of a tokenizer whose pre-tokenizer does not
    split text (e.g. ByteLevel with ``use_regex: false``, the tiny model's).

    The Rust BPE model caches the merges of every pre-tokenized word, up to
    10,000 of them. With no split, each whole prompt is one word: the cache
    keeps up to 10,000 prompts, a long-running gateway's RSS grows with them
    (+6.7% over a 10,000-request soak, +0.4% without the cache), and a hit
    needs the same prompt byte for byte. Tokenizers that split into words
    keep their cache (bounded words, frequent hits). Returns True when the
    cache was turned off."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is None or not hasattr(model, "_resize_cache"):
        return False  # not a BPE model of the tokenizers library
    probe = "three words here"
    pre = backend.pre_tokenizer
    if pre is not None and len(pre.pre_tokenize_str(probe)) > 1:
        return False
    model._resize_cache(0)
    return True


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a completion prompt, with the tokenizer's special tokens (BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=True))


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    allow_fallback: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of an OpenAI-style chat conversation.

    Each message needs a string ``role`` and a ``content`` that is a string
    or a list of ``{"type": "text", "text": str}`` parts (joined with "\\n").
    Raises ``ValueError`` naming the offending field for malformed messages,
    when the tokenizer has no chat template and ``allow_fallback`` is False,
    and when the template itself rejects the conversation.
    """
    conversation = [_normalize_message(i, m) for i, m in enumerate(_check_list(messages))]
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        if not allow_fallback:
            raise ValueError(
                "tokenizer has no chat template; use /v1/completions or a model with one"
            )
        template = FALLBACK_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **({"tools": tools} if tools else {}),
        )
    except Exception as exc:  # jinja2 errors (e.g. raise_exception in the template)
        raise ValueError(f"chat template rejected the messages: {exc}") from exc
    if not isinstance(text, str):
        raise ValueError(f"chat template rendered {type(text).__name__}, expected str")
    return list(tokenizer.encode(text, add_special_tokens=False))


def _check_list(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return messages


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object, got {type(message).__name__}")
    if "role" not in message:
        raise ValueError(f"{where}.role is missing")
    if not isinstance(message["role"], str) or not message["role"]:
        raise ValueError(f"{where}.role must be a non-empty string")
    if message.get("content") is None and message.get("tool_calls"):
        return {**message, "content": ""}  # an assistant turn that only called tools
    if "content" not in message or message["content"] is None:
        raise ValueError(f"{where}.content is missing")
    content = message["content"]
    if isinstance(content, list):
        content = "\n".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    return {**message, "content": content}


def _text_part(where: str, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise ValueError(f"{where} must be a text part {{'type': 'text', 'text': ...}}")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"{where}.text must be a string")
    return part["text"]
