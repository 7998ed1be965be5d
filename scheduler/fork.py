"""Parallel sampling (``n > 1``): one prefill, then ``n`` children that share it.

    parent  computes prompt[:-1]            (samples nothing)
              blocks  [b0 full][b1 full][b2 partial]
    fork    child 0 takes the parent's table        [b0][b1][b2]
            child k shares the full blocks          [b0][b1][bk'] + copy b2 -> bk'
    child   computes the last prompt token itself, samples its own first token

The full blocks are shared by reference count (the pool's ``ref_cnt``); the
partial block is copied once per extra child (copy-on-write done at fork
time: every child writes into it on its very next step). The copies travel
to the runner in ``SchedulerOutput.copy_block_ids`` and run before that
step's forward pass.

Each child recomputes the last prompt token (one token of compute per
child), so every child samples its own first token with its own seed:
child ``i`` uses ``seed + i`` (mod 2**64), and since a seeded draw depends
only on (seed, position), child ``i`` of a seeded request draws exactly what
an independent request with seed ``seed + i`` draws. Greedy children are
identical.

Under P/D the parent runs on P and finishes at the fork point, handing off
``num_tokens - 1`` tokens of KV; D reads them once into its own parent and
forks there. A child that cannot get a block for its copy starts as an
ordinary waiting request (its prompt's full blocks are prefix-cache hits).

Outputs carry the parent's request id and the child's ``index``. Aborting
the parent id aborts every child; a child's own id (``child_request_id``)
aborts only that child.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from tandem.scheduler.kv_cache_manager import KVCacheManager
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import EngineOutput

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler

MAX_N = 128  # children per request


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def is_fork_parent(req: Request) -> bool:
    return req.n > 1 and req.parent_id is None


def is_remote_decode(req: Request) -> bool:
    """A parent on a prefill engine: it hands its KV off instead of forking."""
    params = req.kv_transfer_params
    return bool(params and params.get("do_remote_decode"))


def make_children(parent: Request) -> list[Request]:
    """The parent's ``n`` children, not yet scheduled (no blocks, nothing computed)."""
    sp = parent.sampling_params
    children = []
    for index in range(parent.n):
        params = sp
        if sp.seed is not None and index:
            params = msgspec.structs.replace(sp, seed=(sp.seed + index) % 2**64)
        child = Request(
            child_request_id(parent.request_id, index),
            parent.prompt_token_ids,
            params,
            eos_token_id=parent.eos_token_id,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
        )
        child.arrival_mono = parent.arrival_mono
        child.parent_id = parent.request_id
        child.sample_index = index
        child.block_hashes = list(parent.block_hashes)  # same tokens, same salt
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        children.append(child)
    return children


def fork_blocks(
    kv: KVCacheManager, parent: Request, children: list[Request], max_children: int
) -> tuple[int, list[tuple[int, int]]]:
    """Give the children the parent's KV (``parent.num_computed_tokens`` tokens).

    Child 0 takes the parent's table; each later child takes a reference on
    the full blocks and, when the last block is partial, a new block to copy
    it into. Children are served in order while the pool has blocks, at
    most ``max_children`` (>= 1; the engine's free sequence slots).
    Returns ``(number of children that got the KV, [(src, dst) block ids])``;
    the parent's table is gone afterwards (nothing is freed: its references
    now belong to child 0).
    """
    rid = parent.request_id
    blocks = kv.req_blocks.pop(rid)
    num_cached = kv.num_cached_blocks.pop(rid)
    num_full = parent.num_computed_tokens // kv.block_size
    partial = blocks[num_full:]  # zero or one block
    first = children[0].request_id
    kv.req_blocks[first] = blocks
    kv.num_cached_blocks[first] = num_cached
    num_forked = 1
    copies: list[tuple[int, int]] = []
    for child in children[1:max_children]:
        if len(partial) > kv.pool.num_free_blocks:
            break
        shared = blocks[:num_full]
        kv.pool.touch(shared)
        own = kv.pool.get_new_blocks(len(partial))
        copies.extend((src.block_id, dst.block_id) for src, dst in zip(partial, own))
        kv.req_blocks[child.request_id] = shared + own
        kv.num_cached_blocks[child.request_id] = min(num_cached, num_full)
        num_forked += 1
    return num_forked, copies


class ForkTable:
    """Parent id -> ids of its children still tracked by the scheduler."""

    def __init__(self) -> None:
        self.children: dict[str, set[str]] = {}

    def add(self, parent_id: str, children: list[Request]) -> None:
        self.children[parent_id] = {c.request_id for c in children}

    def discard(self, child: Request) -> None:
        live = self.children.get(child.parent_id or "")
        if live is not None:
            live.discard(child.request_id)
            if not live:
                del self.children[child.parent_id]  # type: ignore[arg-type]

    def expand(self, request_ids: list[str] | tuple[str, ...]) -> list[str]:
        """Request ids with every parent id followed by its children's ids."""
        if not self.children:
            return list(request_ids)
        out = []
        for rid in request_ids:
            out.append(rid)
            out.extend(sorted(self.children.get(rid, ())))
        return out

    def check_integrity(self, requests: dict[str, Request]) -> None:
        for parent_id, live in self.children.items():
            assert live, f"empty fork entry {parent_id}"
            for cid in live:
                assert cid in requests, f"fork child {cid} of {parent_id} is not tracked"
                assert requests[cid].parent_id == parent_id


def start_waiting(child: Request) -> None:
    """A child that got no KV at the fork: it starts like a new request."""
    child.status = RequestStatus.WAITING
    child.num_computed_tokens = 0


# ---- the scheduler's side: forking parents and tracking children ---------------------


def fork_ready_parents(sched: Scheduler, outputs: list[EngineOutput]) -> None:
    """Fork every running parent whose prompt but its last token is computed (the
    scheduler's ``update_from_output``)."""
    for parent in list(sched.fork_parents.values()):
        if (
            parent.status == RequestStatus.RUNNING
            and parent.num_computed_tokens == parent.num_tokens - 1
            and not sched._computing(parent)
        ):
            fork_parent(sched, parent, outputs)


def fork_parent(sched: Scheduler, parent: Request, outputs: list[EngineOutput]) -> None:
    pid = parent.request_id
    del sched.fork_parents[pid]
    sched.running.remove(parent)
    sched.unseen_by_runner.discard(pid)
    sched.finished_req_ids.append(pid)
    if is_remote_decode(parent):
        # P: hand the shared KV off; the decode engine forks
        parent.status = RequestStatus.FINISHED_LENGTH_CAPPED
        out = EngineOutput(
            request_id=pid,
            finish_reason=parent.status.finish_reason,
            num_cached_tokens=max(parent.num_cached_tokens, 0),
        )
        out.kv_transfer_params = sched._free_finished(parent)
        outputs.append(out)
        return
    if sched.connector is not None:  # D: forget the parent's remote-load state
        sched.connector.request_finished(parent, sched.kv.get_block_ids(pid))
    sched.requests.pop(pid)
    if sched.structured is not None:
        sched.structured.remove(parent)  # each child gets its own matcher
    children = make_children(parent)
    num_slots = sched.config.max_num_seqs - len(sched.running) - len(sched.waiting_for_remote)
    num_forked, copies = fork_blocks(sched.kv, parent, children, max(1, num_slots))
    sched.pending_copies.extend(copies)
    add_children(sched, parent, children, num_forked)


def add_children(
    sched: Scheduler, parent: Request, children: list[Request], num_forked: int
) -> None:
    """Track the children: the first ``num_forked`` hold the parent's KV and
    run; the rest start as new requests ahead of other waiting ones."""
    sched.forks.add(parent.request_id, children)
    constrained = parent.sampling_params.structured_outputs is not None
    for child in children:
        child.n = parent.n
        sched.requests[child.request_id] = child
        if constrained:
            sched.structured.matcher_for(child)  # from the cached grammar
    for child in children[:num_forked]:
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        sched.running.append(child)
        sched.unseen_by_runner.add(child.request_id)
    for child in children[num_forked:]:
        start_waiting(child)
    sched.waiting.prepend_all(children[num_forked:])
