"""The scheduler's figures (``SchedulerStats``, sent with every step's outputs) and its
``check_integrity``: every tracked request in exactly one place, no block held by an unknown
request, and, idle, nothing tracked and every block free."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.scheduler import drafting, structured_grammar
from tandem.scheduler.kv_cache_manager import cdiv
from tandem.scheduler.request import RequestStatus
from tandem.wire.engine_protocol import SchedulerStats

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


def make_stats(sched: Scheduler) -> SchedulerStats:
    stats = _base_stats(sched)
    if sched.spec is not None:
        sched.spec.stats.fill(stats)
    return stats


def _base_stats(sched: Scheduler) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=len(sched.running),
        num_waiting_reqs=len(sched.waiting) + len(sched.waiting_for_fsm),
        num_waiting_for_remote_kvs=len(sched.waiting_for_remote),
        kv_cache_usage=sched.kv.usage(),
        num_blocks_held_for_transfer=sched.num_blocks_held_for_transfer(),
        prefix_cache_queries=sched.prefix_cache_queries,
        prefix_cache_hits=sched.prefix_cache_hits,
        num_preemptions=sched.num_preemptions,
        num_prompt_tokens=sched.num_prompt_tokens,
        num_generation_tokens=sched.num_generation_tokens,
    )


def check_integrity(sched: Scheduler, idle: bool = True) -> None:
    """Raise AssertionError on any inconsistency. With ``idle`` (default),
    also require that nothing is tracked and every block is free."""
    sched.kv.check_integrity()
    tracked = (
        {r.request_id for r in sched.running}
        | {r.request_id for r in sched.waiting}
        | set(sched.waiting_for_remote)
        | set(sched.waiting_for_fsm)
        | set(sched.held_for_send)
    )
    assert tracked == set(sched.requests), (
        f"orphaned requests: {sorted(set(sched.requests) ^ tracked)}"
    )
    assert len(sched.running) <= sched.config.max_num_seqs
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING, r
    for rid in sched.kv.req_blocks:
        assert rid in sched.requests, f"blocks held by unknown request {rid}"
    sched.forks.check_integrity(sched.requests)
    structured_grammar.check_integrity(sched)
    if sched.spec is not None:  # between steps: every draft verified, its slot back
        for r in sched.running:
            assert not r.spec_token_ids, f"{r.request_id}: unverified drafts"
            num_blocks = len(sched.kv.req_blocks.get(r.request_id, ()))
            assert num_blocks <= cdiv(r.num_computed_tokens, sched.config.block_size), (
                f"{r.request_id}: {num_blocks} blocks for {r.num_computed_tokens} tokens"
            )
        sched.spec.policy.check_integrity(sched.running)
        drafting.check_integrity(sched)
    for rid, parent in sched.fork_parents.items():
        assert sched.requests.get(rid) is parent, f"fork parent {rid} is not tracked"
    if idle:
        assert not sched.requests, f"requests still tracked: {sorted(sched.requests)}"
        assert sched.kv.num_free_blocks == sched.config.num_kv_blocks, (
            f"{sched.config.num_kv_blocks - sched.kv.num_free_blocks} blocks leaked"
        )
