"""Where ``Scheduler.schedule`` meets speculative decoding: which running requests get
drafts this step, and the drafts the step carries to the runner.

    running r (decoding: its last token is its only uncomputed one, nothing in flight)
      Lookahead.draft -> d1..dK            (scheduler/spec/: proposer, adaptive cap, limits)
      constrained: structured_grammar.cut_drafts -> d1..dj, j <= K  (grammar walk, rolled back)
      r is scheduled with 1 + j tokens; SchedulerOutput.scheduled_spec_decode_tokens[r] = d1..dj

Every proposer's drafts go through here (``Request.spec_token_ids``), so a grammar cuts
a model-based proposer's drafts exactly as it cuts prompt lookup's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.scheduler import structured_grammar
from tandem.scheduler.request import Request

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler
    from tandem.scheduler.spec.lookahead import Lookahead


def num_drafts(sched: Scheduler, spec: Lookahead, req: Request, budget_left: int) -> int:
    """How many drafts a running request scheduled with one token takes this step (0 when
    it is not decoding); sets ``req.spec_token_ids``. ``budget_left``: tokens left after
    its one."""
    if req.num_computed_tokens != req.num_tokens - 1 or req.num_output_placeholders:
        return 0
    drafts = spec.draft(req, budget_left, sched.config.max_model_len)
    if drafts and req.sampling_params.structured_outputs is not None:
        drafts = structured_grammar.cut_drafts(sched, req)
    return len(drafts)


def scheduled_drafts(sched: Scheduler, num_scheduled: dict[str, int]) -> dict[str, list[int]]:
    """The step's drafts per request (``SchedulerOutput.scheduled_spec_decode_tokens``)."""
    spec_tokens = {}
    if sched.spec is not None:
        requests = sched.requests
        for rid in num_scheduled:
            drafts = requests[rid].spec_token_ids
            if drafts:
                spec_tokens[rid] = drafts
    return spec_tokens
