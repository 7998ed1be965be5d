"""Output placeholders: tokens a step in flight will sample, counted before they exist.

The overlapped loop (``scheduler/async_scheduler.py``) schedules step N+1 before step N's
tokens are known. A request that samples in step N carries one placeholder until N's
output is applied, so step N+1 gives it its next token as if N's were already there:

    tokens        p0 p1 p2 | t3 [?]          [?] = step N's token, on the device
    computed      4 (t3 is computed by step N)
    step N+1      schedules 1 token at position 4, reading [?] from step N's output

``max_tokens`` and ``max_model_len`` count placeholders, so a request is never scheduled
past its last token; a stop token (EOS, ``stop_token_ids``) is only known when N's output
is applied, and the token step N+1 then produced for the request is dropped.
"""

from __future__ import annotations

from tandem.scheduler.request import Request


def at_output_limit(req: Request, max_model_len: int) -> bool:
    """Will the request be at ``max_tokens`` or ``max_model_len`` once its in-flight
    tokens land? Then it must not be scheduled again until they do (it finishes)."""
    num_pending = req.num_output_placeholders
    return (
        req.num_output_tokens + num_pending >= req.sampling_params.max_tokens
        or req.num_tokens + num_pending >= max_model_len
    )


def samples_this_step(req: Request) -> bool:
    """Right after ``schedule()``: does the step compute the request's last known (or
    in-flight) token, so that it samples a new one (and its drafts, when it has some)? A
    fork parent never does (it stops one token short of its prompt)."""
    ahead = req.num_output_placeholders + len(req.spec_token_ids)
    return req.num_computed_tokens == req.num_tokens + ahead and not (
        req.n > 1 and req.parent_id is None
    )
