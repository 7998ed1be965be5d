"""Where ``Scheduler.schedule`` meets speculative decoding: which running requests get
drafts this step, the drafts the step carries to the runner, and how far a draft
model's KV catches up.

    running r (decoding: its last token is its only uncomputed one, nothing in flight)
      Lookahead.wanted -> j        (scheduler/spec/: adaptive cap, max_tokens, max_model_len)
      draft model: lag = r's positions before its last token without draft KV
      fits         1 + lag + drafts within the budget left: r drafts, and the draft's
                   first forward recomputes the lag (counted in the budget)
      else         the draft catches up by what the budget leaves, holding the cap for
                   a later step (``Request.spec_hold``); r decodes plainly meanwhile, or,
                   sampled with a seed, waits (see below)
      proposer -> d1..dj; constrained: structured_grammar.cut_drafts (grammar walk, rolled back)
      r is scheduled with 1 + j tokens; SchedulerOutput.scheduled_spec_decode_tokens[r] = d1..dj

Every proposer's drafts go through here (``Request.spec_token_ids``), so a grammar cuts
a model-based proposer's drafts exactly as it cuts prompt lookup's.

**Catch-up.** The runner's copy of a request starts with no draft KV whenever it is new
(admission, a prefix hit, KV from a prefill engine or a tier, resumption, a fork child,
migration), so a draft model must recompute those positions before its drafts are worth
anything: a P/D handoff's whole prompt. That work is a prefill of the draft, and it is
scheduled like one: each step gives it what the token budget leaves after the tokens
before it (``SchedulerOutput.draft_catch_up``, counted in ``total_num_scheduled_tokens``),
so no step grows past ``max_num_batched_tokens`` however many prompts arrive together.
The scheduler mirrors the runner's count (``Request.draft_computed``; ``check_integrity``
compares them): +catch-up +drafts per step, cut to the computed tokens on verification,
0 whenever the runner gets a new copy.

A request behind by more than the budget allows decodes without drafts while its draft
catches up: a greedy request's tokens do not depend on which steps carried drafts, and
an unseeded sampled one's follow the target's distribution either way. A seeded sampled
request's tokens do depend on which positions were drafted (drafted positions are decided
by the acceptance test's stream, others by the plain sampler's), and how fast a draft
catches up depends on the batch's budget; so a seeded request emits nothing until its
draft is caught up, then drafts as it would have with an unchunked catch-up, and its
tokens stay independent of its batch mates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.scheduler import admission, structured_grammar
from tandem.scheduler.messages import NewRequestData
from tandem.scheduler.request import Request
from tandem.scheduler.spec.adaptive import is_seeded

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler
    from tandem.scheduler.spec.lookahead import Lookahead


def decode_step(
    sched: Scheduler, spec: Lookahead, req: Request, budget: int, index: int
) -> tuple[int, int]:
    """A running request (``sched.running[index]``) whose step would compute one token,
    with ``budget`` tokens left (its catch-up leaves a token to each request after it):
    ``(tokens to schedule, draft positions to recompute)``. Tokens: 1 + its drafts, 1, or
    0 (a seeded request waiting for its draft). Sets ``req.spec_token_ids`` (and
    ``req.spec_hold`` when the draft is behind)."""
    if req.num_computed_tokens != req.num_tokens - 1 or req.num_output_placeholders:
        return 1, 0  # not decoding (its last token is in flight)
    want = spec.wanted(req, sched.config.max_model_len)
    if want == 0:
        return 1, 0
    lag = spec.lag(req)
    reserve = len(sched.running) - index - 1
    spare = max(budget - 1 - reserve, 0)  # what its catch-up may take beside its token
    chunk = sched.config.long_prefill_token_threshold or budget  # a catch-up is a prefill
    # drafts that fit beside its token and its draft's catch-up (as many as before the
    # catch-up was budgeted: drafts never left later requests a token)
    room = budget - 1 - lag if lag <= min(spare, chunk) else 0
    if is_seeded(req):
        # all its drafts or none: how many it gets must not depend on its batch mates
        want = min(want, sched.config.max_num_batched_tokens - 1)
        if want <= 0:
            return 1, 0
        if lag and room < want:  # a draft model's: as many drafts as it wants
            req.spec_hold = want  # waits (its draft catching up) for a step with room
            return 0, min(lag, spare + 1, chunk)
        drafts = _propose(sched, spec, req, want)
        if len(drafts) > room:
            req.spec_token_ids, req.spec_hold = [], want  # waits for a step with room
            return 0, 0
        return 1 + len(drafts), lag
    if room < 1:
        if lag == 0:
            return 1, 0  # the budget is spent: no draft this step
        req.spec_hold = want  # drafts once its draft has caught up; decodes plainly now,
        # and the draft may compute the position of the last token too (its slot is held)
        return 1, min(lag + 1, spare, chunk)
    return 1 + len(_propose(sched, spec, req, min(want, room))), lag


def _propose(sched: Scheduler, spec: Lookahead, req: Request, num: int) -> list[int]:
    drafts = spec.propose(req, num)
    if drafts and req.sampling_params.structured_outputs is not None:
        drafts = structured_grammar.cut_drafts(sched, req)
    return drafts


def catch_up_only(
    sched: Scheduler,
    req: Request,
    num: int,
    catch_up: dict[str, int],
    new_reqs: list[NewRequestData],
) -> int:
    """A request that computes no token this step but whose draft catches up by ``num``
    positions: recorded (the runner gets its copy now if it has none). The budget used."""
    if record(catch_up, req, num):
        if req.request_id in sched.unseen_by_runner:
            sched.unseen_by_runner.discard(req.request_id)
            new_reqs.append(admission.new_request_data(sched, req))
    return num


def record(catch_up: dict[str, int], req: Request, num: int) -> int:
    """``req``'s draft catches up by ``num`` positions this step; the budget used."""
    if num:
        catch_up[req.request_id] = num
    return num


def take_back(
    victim: Request,
    catch_up: dict[str, int],
    num_scheduled: dict[str, int],
    new_reqs: list[NewRequestData],
) -> int:
    """A request preempted after its draft's catch-up was scheduled: the catch-up is
    dropped (and the runner's copy, if this step made one). The budget given back."""
    if victim.request_id not in num_scheduled:
        new_reqs[:] = [n for n in new_reqs if n.req_id != victim.request_id]
    return catch_up.pop(victim.request_id)


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


def advance(sched: Scheduler, num_scheduled: dict[str, int], catch_up: dict[str, int]) -> None:
    """The scheduled step's draft KV, as the runner will hold it once the step ran: each
    catch-up's positions, and a draft model's drafts (verification cuts them back to the
    kept ones, ``Lookahead.accept``)."""
    spec = sched.spec
    if spec is None:
        return
    requests = sched.requests
    for rid, num in catch_up.items():
        requests[rid].draft_computed += num
    if spec.config.uses_draft_model:
        for rid in num_scheduled:
            req = requests[rid]
            req.draft_computed += len(req.spec_token_ids)


def check_integrity(sched: Scheduler) -> None:
    """Between steps: no request counts draft KV past its computed tokens."""
    for r in sched.running:
        assert 0 <= r.draft_computed <= r.num_computed_tokens, (
            f"{r.request_id}: draft KV for {r.draft_computed} positions, "
            f"{r.num_computed_tokens} computed"
        )
        assert 0 <= r.spec_hold <= sched.spec.k, (r.request_id, r.spec_hold)
