"""Prompt logprobs (vLLM's ``prompt_logprobs``): for each prompt token after
the first, its log-probability given the tokens before it, its rank, and the
top alternatives.

A prefill chunk's hidden state at position p predicts token p + 1:

    positions      start ............................ end-1
    targets        tokens[start+1] ................. tokens[end]
    kept           targets inside the prompt (the last prompt position's
                   prediction is the first output token: sampled, not here)

Logits of a chunk are computed ``ROWS_PER_PIECE`` rows at a time, so a long
prompt never holds ``[prompt_len, vocab]`` floats at once.
"""

from __future__ import annotations

import torch

from tandem.wire.engine_protocol import Logprobs
from tandem.workers.sampling.sampler import _top_logprobs

ROWS_PER_PIECE = 256


def prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits,
    targets: list[int],
    num_top: int,
) -> list[Logprobs]:
    """``hidden`` ``[k, H]`` rows predicting ``targets`` (k ids); ``compute_logits``
    maps hidden rows to raw logits ``[k, V]``."""
    result: list[Logprobs] = []
    for begin in range(0, len(targets), ROWS_PER_PIECE):
        piece_targets = targets[begin : begin + ROWS_PER_PIECE]
        logits = compute_logits(hidden[begin : begin + len(piece_targets)]).float()
        logprobs = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(piece_targets, device=logprobs.device).unsqueeze(1)
        target_lp = logprobs.gather(1, target)
        ranks = (logprobs > target_lp).sum(dim=-1).add_(1).tolist()
        top_ids, top_lps = _top_logprobs(logprobs, [min(num_top, logprobs.shape[1])] * len(ranks))
        for j, token_id in enumerate(piece_targets):
            result.append(
                Logprobs(
                    token_id=token_id,
                    logprob=float(target_lp[j, 0]),
                    top_token_ids=top_ids[j],
                    top_logprobs=top_lps[j],
                    rank=ranks[j],
                )
            )
    return result
