"""Batched logits transforms: repetition / frequency / presence penalties,
logit bias, min-p. Pure tensor functions, one row per request, no Python
loop over rows.

Penalties follow vLLM's semantics (OpenAI's for frequency and presence):

    seen       = token in the prompt or in the output so far
    logits     = where(seen, logits / r if logits > 0 else logits * r, logits)
    logits    -= frequency * output_count     (output tokens only)
    logits    -= presence  * (output_count > 0)
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of ``logits`` ``[N, V]`` (float32).

    ``prompt_mask`` ``[N, V]`` bool: token occurs in the prompt;
    ``output_counts`` ``[N, V]`` int: occurrences in the output so far;
    ``repetition``, ``frequency``, ``presence``: ``[N]`` float32 (neutral
    values 1, 0, 0 leave a row unchanged bit for bit).
    """
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    rep = repetition.unsqueeze(1)
    scale = torch.where(logits > 0, 1.0 / rep, rep)
    out = torch.where(seen, logits * scale, logits)
    out = out - frequency.unsqueeze(1) * output_counts.to(out.dtype)
    return out - presence.unsqueeze(1) * output_mask.to(out.dtype)


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability is below ``min_p`` times the row's highest
    probability set to -inf (``min_p`` ``[N]``; 0 keeps every token).
    ``scaled``: temperature-scaled logits. The most likely token always stays."""
    # p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p)
    top = scaled.amax(dim=-1, keepdim=True)
    threshold = top + torch.log(min_p).unsqueeze(1)
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def banned_last_tokens(bad_words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """Token ids a request may not sample next: the last token of every bad
    word whose other tokens are the end of the output so far (a one-token
    bad word is always banned)."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or output_token_ids[-len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned
