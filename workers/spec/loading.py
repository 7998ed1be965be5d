"""The draft model at engine start: resolved as ``--model`` is, checked against the target.

A draft must share the target's vocabulary: verification compares the draft's token ids
and distributions with the target's row for row. So its LM head has the target's number
of rows, and (when the two come from different directories) its tokenizer maps every
token to the same id. Otherwise the engine refuses to start with a ``ValueError`` naming
``speculative_config.model``. A draft that is the target itself (same directory) shares
the target's weights: only its KV cache is its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.workers.checkpoints.loader import load_model, resolve_model_path

_FIELD = "speculative_config.model"


@dataclass
class LoadedDraft:
    name: str  # as configured
    path: str  # its resolved directory
    model: Any  # workers.models module (the target's own when path is the target's)
    max_context_len: int


def load_draft_model(
    spec: SpeculativeConfig | None,
    target_path: str,
    target_model: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> LoadedDraft | None:
    """The draft of a ``draft_model`` config (None for other methods), in the target's
    dtype on its device; ``ValueError`` naming ``speculative_config.model`` when it
    cannot be found or does not share the target's vocabulary."""
    if spec is None or not spec.uses_draft_model:
        return None
    name = spec.model or ""
    try:
        path = resolve_model_path(name)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"{_FIELD} {name!r}: {exc}") from None
    if path == target_path:
        model = target_model
    else:
        model, _ = load_model(path, dtype, device)
        check_vocabulary(name, target_path, path, target_model.vocab_size, model.vocab_size)
    return LoadedDraft(name, path, model, model.max_context_len)


def check_vocabulary(
    name: str, target_path: str, draft_path: str, target_rows: int, draft_rows: int
) -> None:
    """Same LM-head rows and, where both directories hold a tokenizer, the same
    token-to-id map."""
    if target_rows != draft_rows:
        raise ValueError(
            f"{_FIELD} {name!r} has a vocabulary of {draft_rows} tokens, the target "
            f"{target_rows}: a draft model must share the target's tokenizer"
        )
    target_vocab, draft_vocab = _vocab(target_path), _vocab(draft_path)
    if target_vocab is None or draft_vocab is None or target_vocab == draft_vocab:
        return
    differ = sum(1 for t, i in draft_vocab.items() if target_vocab.get(t) != i)
    differ += len(set(target_vocab) - set(draft_vocab))
    raise ValueError(
        f"{_FIELD} {name!r} has another tokenizer than the target ({differ} tokens differ): "
        f"a draft model must share the target's tokenizer"
    )


def _vocab(path: str) -> dict[str, int] | None:
    from tandem.workers.text.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError):
        return None  # a directory without tokenizer files: the row count decides
    return dict(tokenizer.get_vocab())
