"""A step's results applied to the scheduler's requests (``Scheduler.update_from_output``):

    runner output  r1: [t]   r2: [d1 d2 t]   r3: []           (r3: a partial prefill chunk)
    per request    rejected drafts' slots back (spec), each token appended and checked for a
                   stop (EOS, stop ids, max_tokens, max_model_len) and, constrained, fed to
                   the grammar: a run of accepted drafts is cut where the plain engine stops
    finished       out of the running set; blocks freed or held for a peer (connector)
    -> EngineOutputs (new tokens, logprobs, finish reason) for the gateway

Only the tokens kept advance a constrained request's matcher: the scheduler's tentative walks
through drafts were rolled back when the step's bitmask was built.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tandem.scheduler import fork, remote_kv, structured_grammar
from tandem.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import EngineOutput, EngineOutputs

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


def update_from_output(
    sched: Scheduler, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
) -> EngineOutputs:
    outputs = sched.pending_outputs
    sched.pending_outputs = []
    if runner_output.kv_connector_output is not None:
        remote_kv.update_kv_transfers(sched, runner_output.kv_connector_output, outputs)
    if sched.fork_parents:
        fork.fork_ready_parents(sched, outputs)
    logprobs = runner_output.logprobs
    requests = sched.requests
    for idx, (rid, token_ids) in enumerate(
        zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
    ):
        if not token_ids:
            continue  # partial prefill chunk
        req = requests.get(rid)
        if req is None or req.status != RequestStatus.RUNNING:
            continue  # finished or preempted meanwhile
        if req.spec_token_ids:
            sched.spec.accept(req, len(token_ids))  # rejected drafts' slots back
        new_tokens, status = take_tokens(sched, req, token_ids)
        sched.num_generation_tokens += len(new_tokens)
        out = EngineOutput(request_id=rid, new_token_ids=new_tokens)
        if req.parent_id is not None:  # a fork child: the client's id and its choice
            out.request_id, out.index = req.parent_id, req.sample_index
        if len(req.all_token_ids) - req.num_prompt_tokens == len(new_tokens):
            # the request's first output: the gateway learns its prefix hit now
            out.num_cached_tokens = max(req.num_cached_tokens, 0)
        if logprobs is not None:
            out.new_logprobs = logprobs[idx][: len(new_tokens)]
        if runner_output.prompt_logprobs is not None:
            out.prompt_logprobs = runner_output.prompt_logprobs.get(rid)
        if status is not None:
            req.status = status
            out.finish_reason = status.finish_reason
            out.stop_reason = req.stop_reason
            out.error = req.error
            out.num_cached_tokens = max(req.num_cached_tokens, 0)
            sched.running.remove(req)
            sched.finished_req_ids.append(rid)
            out.kv_transfer_params = sched._free_finished(req)
        outputs.append(out)
    return EngineOutputs(engine_id=sched.engine_id, outputs=outputs, timestamp=time.time())


def take_tokens(
    sched: Scheduler, req: Request, token_ids: list[int]
) -> tuple[list[int], RequestStatus | None]:
    """Append the step's tokens to ``req`` (one, or accepted drafts + one), each as if it
    were its own step's: stop checks, then the grammar (a constrained request). The tokens
    kept, and the request's new status (None: it goes on)."""
    cfg_max_len = sched.config.max_model_len
    status = None
    constrained = req.sampling_params.structured_outputs is not None
    if len(token_ids) == 1:
        req.all_token_ids.append(token_ids[0])
        status = check_stop(req, token_ids[0], cfg_max_len)
        if constrained:
            status = structured_grammar.advance(sched, req, token_ids, status)
        return token_ids, status
    new_tokens = []
    for tok in token_ids:
        req.all_token_ids.append(tok)
        new_tokens.append(tok)
        status = check_stop(req, tok, cfg_max_len)
        if constrained:
            status = structured_grammar.advance(sched, req, [tok], status)
        if status is not None:
            break
    return new_tokens, status


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    sp = req.sampling_params
    num_tokens = len(req.all_token_ids)
    num_output = num_tokens - req.num_prompt_tokens
    if num_output >= sp.min_tokens:
        if token == req.eos_token_id and not sp.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if sp.stop_token_ids and token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if num_output >= sp.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
