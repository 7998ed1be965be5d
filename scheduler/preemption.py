"""Preemption: a running request gives its blocks back and waits again (it recomputes
from its tokens). Under KV pressure the scheduler preempts from the back of the running
set; under the priority policy an arriving request preempts those it outranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.scheduler import policies
from tandem.scheduler.kv_cache_manager import cdiv
from tandem.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


def preempt_for_arrival(sched: Scheduler, preempted: list[str]) -> None:
    """Priority policy: preempt running requests with a larger priority
    value until the best waiting request could be admitted."""
    cfg = sched.config
    head = sched.waiting.peek()
    num_first = min(head.num_tokens - head.num_computed_tokens, cfg.max_num_batched_tokens)
    if cfg.long_prefill_token_threshold:
        num_first = min(num_first, cfg.long_prefill_token_threshold)
    num_blocks = cdiv(head.num_computed_tokens + num_first, cfg.block_size) + sched.margin_blocks
    while (
        len(sched.running) + len(sched.waiting_for_remote) >= cfg.max_num_seqs
        or sched.kv.num_free_blocks < num_blocks
    ):
        victim = policies.arrival_victim(sched.running, head)
        if victim is None:
            return
        preempt(sched, victim)
        preempted.append(victim.request_id)


def preempt(sched: Scheduler, req: Request) -> None:
    """Back to the head of the waiting queue, its blocks freed; it recomputes."""
    sched.running.remove(req)
    sched.unseen_by_runner.discard(req.request_id)
    sched.kv.free(req)
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.num_output_placeholders = 0  # an in-flight token is dropped and recomputed
    req.spec_token_ids = []  # its drafts are dropped with its blocks
    req.draft_computed = 0  # and the runner's copy, with its draft KV
    req.num_preemptions += 1
    sched.num_preemptions += 1
    sched.waiting.prepend(req)
