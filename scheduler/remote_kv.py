"""Remote KV in the scheduler: requests in ``WAITING_FOR_REMOTE_KVS`` whose blocks the KV
connector reports loaded (from a prefill engine over NIXL, or from this engine's own KV
tiers), and requests whose blocks were held for a decode engine's READ.

A load that left blocks invalid is failed (``--load-failure-policy fail``) or recomputed
from its first bad block; a load from the engine's own tiers is always recomputed and its
tokens count as cached. Functions of the scheduler (``Scheduler.update_from_output``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import EngineOutput

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


def update_kv_transfers(sched: Scheduler, kv_out: Any, outputs: list[EngineOutput]) -> None:
    if sched.connector is not None:
        sched.connector.update_connector_output(kv_out)
    invalid = set(kv_out.invalid_block_ids)
    for rid in kv_out.finished_recving:
        req = sched.waiting_for_remote.pop(rid, None)
        if req is None:
            continue
        if req.is_finished:  # aborted during the read: blocks are safe to free now
            sched._release(req)
            continue
        finish_remote_load(sched, req, invalid, outputs)
    for rid in kv_out.finished_sending:
        req = sched.held_for_send.pop(rid, None)
        if req is not None:
            sched._release(req)


def finish_remote_load(
    sched: Scheduler, req: Request, invalid: set[int], outputs: list[EngineOutput]
) -> None:
    block_ids = sched.kv.get_block_ids(req.request_id)
    bad = [i for i, b in enumerate(block_ids) if b in invalid]
    if bad:
        tier_load = own_tier_load(sched, req)  # always recomputed
        if sched.config.load_failure_policy == "fail" and not tier_load:
            req.status = RequestStatus.FINISHED_ERROR
            req.error = "remote KV load failed"
            sched._release(req)
            outputs.append(
                EngineOutput(
                    request_id=req.request_id,
                    finish_reason=req.status.finish_reason,
                    error=req.error,
                )
            )
            return
        # Recompute from the first bad block on; earlier blocks are good.
        req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * sched.config.block_size)
        if tier_load:
            req.num_cached_tokens = min(req.num_cached_tokens, req.num_computed_tokens)
        sched.kv.truncate_computed(req, req.num_computed_tokens)
    # The KV is in place: publish the filled blocks for prefix hits and
    # stop treating the request as remote (a later preemption recomputes).
    # It joins the running set directly: it holds blocks, so it must be
    # preemptable like any running request (a waiting request holding
    # blocks could deadlock the pool).
    sched.kv.cache_blocks(req, req.num_computed_tokens)
    # a prefill that borrowed its prefix (kvtransfer/params.py) still hands off
    handoff = bool(req.kv_transfer_params and req.kv_transfer_params.get("do_remote_decode"))
    req.kv_transfer_params = {"do_remote_decode": True} if handoff else None
    req.status = RequestStatus.RUNNING
    if req.first_scheduled_time is None:
        req.first_scheduled_time = time.time()
    sched.running.append(req)
    sched.unseen_by_runner.add(req.request_id)


def own_tier_load(sched: Scheduler, req: Request) -> bool:
    """KV tiers (kvtransfer/tiers/): is req's load from this engine's own tiers (or a
    prefix a peer lent from its host tier) rather than a peer's prefill? Its tokens
    are cached tokens, its bad blocks recomputed."""
    own = getattr(sched.connector, "loads_from_own_tiers", None)
    return own is not None and own(req)
