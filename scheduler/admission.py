"""Admission: whether a request may be queued at all (``validate_request``), and which
waiting requests join the running set this step, with how many tokens and which blocks
(``Scheduler.schedule`` runs it after the running requests got theirs)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tandem.scheduler import fork, policies
from tandem.scheduler.kv_cache_manager import cdiv
from tandem.scheduler.messages import NewRequestData
from tandem.scheduler.remote_kv import own_tier_load
from tandem.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


def validate_request(sched: Scheduler, request: Request) -> None:
    """``Scheduler.add_request``'s checks: ``ValueError`` naming the bad field."""
    if request.request_id in sched.requests or request.request_id in sched.forks.children:
        raise ValueError(f"request_id {request.request_id!r} is already in use")
    if not isinstance(request.n, int) or not 1 <= request.n <= fork.MAX_N:
        raise ValueError(f"n must be an integer in [1, {fork.MAX_N}], got {request.n!r}")
    if request.num_prompt_tokens == 0:
        raise ValueError("prompt_token_ids must not be empty")
    if request.num_prompt_tokens >= sched.config.max_model_len:
        raise ValueError(
            f"prompt_token_ids has {request.num_prompt_tokens} tokens; it must be shorter "
            f"than max_model_len ({sched.config.max_model_len})"
        )
    salt = request.cache_salt
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string when given, got {salt!r}")
    request.sampling_params.validate()


def schedule_waiting(
    sched: Scheduler,
    budget: int,
    num_scheduled: dict[str, int],
    new_reqs: list[NewRequestData],
    limits: policies.PrefillLimits,
) -> int:
    cfg = sched.config
    connector = sched.connector
    threshold = cfg.long_prefill_token_threshold
    skipped: list[Request] = []
    # Requests waiting for remote KV count against max_num_seqs: they join
    # the running set as soon as their KV lands.
    while (
        sched.waiting
        and budget > 0
        and len(sched.running) + len(sched.waiting_for_remote) < cfg.max_num_seqs
    ):
        req = sched.waiting.peek()
        computed_blocks = None
        num_new_computed = 0
        num_external = 0
        load_async = False
        if req.num_computed_tokens == 0:
            computed_blocks, num_new_computed = sched.kv.get_computed_blocks(req)
            if connector is not None:
                num_external, load_async = connector.get_num_new_matched_tokens(
                    req, num_new_computed
                )
        num_computed = req.num_computed_tokens + num_new_computed + num_external
        if load_async:
            num_new = 0  # blocks only; the tokens arrive by the read
        else:
            num_new = req.num_tokens - num_computed
            if req.n > 1 and req.parent_id is None:
                num_new -= 1  # a fork parent stops before the last prompt token
            if limits.active and not limits.allows(num_new):
                if limits.max_num_partial and limits.num >= limits.max_num_partial:
                    break  # no prefill slot left this step
                sched.waiting.pop()  # a long prompt at its limit: shorter ones overtake
                skipped.append(req)
                continue
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget and not cfg.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
        if sched.margin_blocks and not room_after_margin(
            sched, num_computed + num_new, computed_blocks
        ):
            break  # admitting it would eat into the blocks kept for growth
        new_block_ids = sched.kv.allocate_slots(
            req,
            num_new + num_external,
            num_new_computed,
            computed_blocks,
            delay_cache_blocks=load_async,
        )
        if new_block_ids is None:
            break  # no room; it keeps its place at the head of the queue
        sched.waiting.pop()
        if req.num_computed_tokens == 0:
            sched.prefix_cache_queries += req.num_tokens
            sched.prefix_cache_hits += num_new_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_new_computed
                if num_external and own_tier_load(sched, req):
                    req.num_cached_tokens += num_external  # the engine's own hit
        block_ids = sched.kv.get_block_ids(req.request_id)
        if connector is not None:
            connector.update_state_after_alloc(req, block_ids, num_external)
        req.num_computed_tokens = num_computed
        if load_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            sched.waiting_for_remote[req.request_id] = req
            continue
        if num_new == 0:
            if req.n > 1 and req.parent_id is None:
                # a fork parent whose whole prefill was a prefix hit:
                # update_from_output forks it
                req.status = RequestStatus.RUNNING
                sched.running.append(req)
                continue
            skipped.append(req)  # nothing fits this step
            continue
        if limits.active:
            limits.take(req.num_tokens - num_computed)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        sched.running.append(req)
        num_scheduled[req.request_id] = num_new
        budget -= num_new
        new_reqs.append(new_request_data(sched, req))
    if skipped:
        sched.waiting.prepend_all(skipped)
    return budget


def new_request_data(sched: Scheduler, req: Request) -> NewRequestData:
    """The runner's new copy of ``req`` (it holds no draft-model KV of it yet)."""
    req.draft_computed = 0
    return NewRequestData(
        req_id=req.request_id,
        all_token_ids=list(req.all_token_ids),
        num_prompt_tokens=req.num_prompt_tokens,
        sampling_params=req.sampling_params,
        block_ids=sched.kv.get_block_ids(req.request_id),
        num_computed_tokens=req.num_computed_tokens,
    )


def room_after_margin(sched: Scheduler, num_tokens: int, computed_blocks) -> bool:
    """Would a waiting request holding ``num_tokens`` tokens leave the
    admission margin free? Always yes for a lone request."""
    if not sched.running and not sched.waiting_for_remote:
        return True
    hits = computed_blocks or ()
    num_taken = cdiv(num_tokens, sched.config.block_size) - len(hits)
    num_taken += sum(1 for b in hits if b.ref_cnt == 0)  # revived from the free queue
    return sched.kv.num_free_blocks - num_taken >= sched.margin_blocks
