"""The scheduler's side of structured outputs (grammar-constrained requests).

    add_request ──> WAITING_FOR_FSM ──(grammar compiled)──> WAITING ──> RUNNING ...
                         │ invalid for this engine, or past the compile deadline
                         └──> FINISHED_ERROR (an error output; never a hang)

The grammar work itself is the engine's ``workers.structured.manager.StructuredOutputManager``
(``Scheduler.structured``, duck-typed: this package imports no grammar library). While a
request's grammar compiles on the manager's pool, it holds no blocks and other requests run.

Each step, every constrained request that samples gets one bitmask row
(``SchedulerOutput.grammar_bitmask``, filled after scheduling: its tokens are all known) and
the sampler masks its logits (``workers/sampling/grammar_mask.py``); unconstrained steps carry
none. When the step's tokens come back, the request's matcher advances by them.

Speculative decoding: a constrained request's drafts are cut at the first one its grammar
refuses (``cut_drafts``, right after they are proposed); its step then has ``1 + k`` rows, row
``j`` filled with the matcher walked through ``d1 .. dj`` and rolled back, and verification
masks each position's logits with its row (``workers/sampling/spec_verify.py``). Only the
tokens verification keeps (accepted drafts + the target's one) advance the matcher. A grammar that
has ended allows only EOS next, so the request ends on EOS like any other (the gateway drops a
final EOS from the text, never a grammar's last token); with ``ignore_eos`` the accepted EOS
ends it. A token the matcher refuses (impossible unless the mask was wrong) ends it in error.

The overlapped loop schedules step N+1 before N's tokens are known. A constrained request's
mask needs its token from N, so a step with such a row defers every row
(``Scheduler.grammar_deferred``). The loop then applies N before it launches N+1
(``workers/runner/async_step.OverlappedLoop``) and fills the rows with ``take_deferred_bitmask``.
Such steps lose the overlap; steps without a constrained row keep it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.scheduler.messages import GrammarBitmask
from tandem.scheduler.placeholders import samples_this_step
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import EngineOutput

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


def wait_for_grammar(sched: Scheduler, req: Request) -> None:
    if sched.structured is None:
        raise ValueError("structured_outputs is not available on this engine")
    req.status = RequestStatus.WAITING_FOR_FSM
    sched.requests[req.request_id] = req
    sched.waiting_for_fsm[req.request_id] = req
    sched.structured.submit(req)


def admit_ready(sched: Scheduler) -> None:
    """Queue every request whose grammar is ready; end those whose compile failed."""
    for rid, req in list(sched.waiting_for_fsm.items()):
        try:
            ready = sched.structured.poll(req)
        except ValueError as exc:
            del sched.waiting_for_fsm[rid]
            sched.requests.pop(rid, None)
            sched.structured.remove(req)
            req.status = RequestStatus.FINISHED_ERROR
            req.error = str(exc)
            sched.pending_outputs.append(
                EngineOutput(
                    request_id=rid, finish_reason=req.status.finish_reason, error=req.error
                )
            )
            continue
        if ready:
            del sched.waiting_for_fsm[rid]
            del sched.requests[rid]
            sched._admit(req)


def forget(sched: Scheduler, req: Request) -> None:
    """A request finished (aborted) while its grammar compiled."""
    sched.waiting_for_fsm.pop(req.request_id, None)
    sched.requests.pop(req.request_id, None)
    sched.structured.remove(req)


def bitmask(sched: Scheduler, num_scheduled: dict[str, int]) -> GrammarBitmask | None:
    """The rows of this step's constrained requests that sample (after scheduling). When one
    of them has its previous token still in flight (the overlapped loop), every row waits for
    ``take_deferred_bitmask``: the loop applies the step in flight first."""
    requests = sched.requests
    reqs = [
        req
        for rid in num_scheduled
        if (req := requests[rid]).sampling_params.structured_outputs is not None
        and samples_this_step(req)
    ]
    if not reqs:
        return None
    if any(req.num_output_placeholders for req in reqs):
        sched.grammar_deferred = reqs
        return None
    return _rows(sched, reqs)


def _rows(sched: Scheduler, reqs: list[Request]) -> GrammarBitmask:
    """A request with ``k`` drafts has ``1 + k`` rows, its id repeated once per row."""
    req_ids = []
    for r in reqs:
        req_ids += [r.request_id] * (1 + len(r.spec_token_ids))
    return GrammarBitmask(req_ids, sched.structured.bitmask(reqs))


def cut_drafts(sched: Scheduler, req: Request) -> list[int]:
    """Speculative decoding: keep the request's drafts (``req.spec_token_ids``, whoever
    proposed them) up to the first one its grammar refuses. A refused draft could never be
    accepted (its row's mask forbids it), and every kept one gets a mask row
    (``bitmask``). The matcher is walked through them and rolled back: it stays at the
    request's known tokens until the step's verified tokens come back (``advance``)."""
    drafts = req.spec_token_ids
    num = sched.structured.num_allowed_drafts(req, drafts)
    if num < len(drafts):
        req.spec_token_ids = drafts = drafts[:num]
    return drafts


def take_deferred_bitmask(sched: Scheduler) -> GrammarBitmask:
    """The deferred rows, once the step in flight was applied (its tokens advanced the
    matchers). A request that finished meanwhile gets no row: the loop drops its token."""
    reqs, sched.grammar_deferred = sched.grammar_deferred, []
    live = [r for r in reqs if not r.is_finished and r.request_id in sched.structured.matchers]
    return _rows(sched, live)


def advance(
    sched: Scheduler, req: Request, tokens: list[int], status: RequestStatus | None
) -> RequestStatus | None:
    """Move the request's matcher over its new tokens; the request's new status."""
    if sched.structured.accept(req, tokens) != len(tokens):
        req.error = "structured_outputs: a sampled token does not match the grammar"
        return RequestStatus.FINISHED_ERROR
    if status is None and sched.structured.is_terminated(req):
        # the grammar took its end token although EOS does not stop the request (ignore_eos)
        last = tokens[-1]
        if last == req.eos_token_id or last in req.sampling_params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    return status


def check_integrity(sched: Scheduler) -> None:
    for rid, req in sched.waiting_for_fsm.items():
        assert sched.requests.get(rid) is req, f"{rid} waits for its grammar untracked"
        assert req.status == RequestStatus.WAITING_FOR_FSM, req
        assert not sched.kv.req_blocks.get(rid), f"{rid} holds blocks while its grammar compiles"
    if sched.structured is not None:
        sched.structured.check_integrity(set(sched.requests))
