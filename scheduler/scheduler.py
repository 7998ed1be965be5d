"""The per-engine scheduler.

Each step gives requests tokens under a token budget and a sequence cap:

    running  : [r1 decode 1][r2 chunk 512][r3 decode 1]   <- served first
    waiting  : [r4 prompt 900 (hit 256)] [r5 ...]         <- admitted while budget lasts
    remote   : {r6: blocks being filled by a NIXL read}   <- skipped until loaded

A request computes ``num_tokens - num_computed_tokens`` tokens; prefill,
chunked prefill, prefix hits, resumption and remote KV all reduce to that.
When a running request cannot get a block, the lowest-priority (FCFS: newest)
running request is preempted: its blocks are freed and it recomputes later.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.scheduler import (
    admission,
    drafting,
    fork,
    integrity,
    outputs,
    policies,
    preemption,
    structured_grammar,
)
from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.kv_cache_manager import KVCacheManager
from tandem.scheduler.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tandem.scheduler.placeholders import at_output_limit
from tandem.scheduler.queues import create_queue
from tandem.scheduler.request import Request, RequestStatus
from tandem.scheduler.spec.lookahead import Lookahead
from tandem.wire.engine_protocol import EngineOutput, EngineOutputs, SchedulerStats


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        connector=None,  # kvtransfer.base.KVConnectorSchedulerSide (duck-typed: no import)
        engine_id: str = "",
        structured=None,  # workers.structured.manager.StructuredOutputManager (duck-typed)
    ) -> None:
        self.config = config
        self.connector = connector
        self.structured = structured
        self.engine_id = engine_id
        self.kv = KVCacheManager(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_caching_hash_algo,
        )
        self.requests: dict[str, Request] = {}  # every request that holds state here
        self.waiting = create_queue(policies.queue_kind(config.policy))
        self.margin_blocks = policies.margin_blocks(
            config.num_kv_blocks, config.kv_admission_margin
        )
        self.running: list[Request] = []
        self.waiting_for_remote: dict[str, Request] = {}
        # constrained requests whose grammar is still compiling (structured_grammar.py)
        self.waiting_for_fsm: dict[str, Request] = {}
        # overlapped loop: constrained requests of the step just scheduled whose mask waits
        # for their token in flight (structured_grammar.take_deferred_bitmask)
        self.grammar_deferred: list[Request] = []
        self.held_for_send: dict[str, Request] = {}  # finished; blocks kept for a peer
        # Running requests the model runner has not seen yet (remote KV just
        # landed): their first scheduled step sends NewRequestData.
        self.unseen_by_runner: set[str] = set()
        self.finished_req_ids: list[str] = []  # runner must forget these next step
        self.pending_outputs: list[EngineOutput] = []  # outputs produced outside a step
        # parallel sampling (scheduler/fork.py): parents still prefilling,
        # live children per parent id, block copies for the next step
        self.fork_parents: dict[str, Request] = {}
        self.forks = fork.ForkTable()
        self.pending_copies: list[tuple[int, int]] = []
        # speculative decoding (scheduler/spec/): drafts as lookahead tokens
        self.spec = Lookahead(config.speculative, self.kv) if config.speculative else None
        # cumulative stats
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate and queue. Raises ``ValueError`` naming the bad field."""
        admission.validate_request(self, request)
        if request.sampling_params.structured_outputs is not None:
            structured_grammar.wait_for_grammar(self, request)
            return
        self._admit(request)

    def _admit(self, request: Request) -> None:
        """Queue a validated request (whose grammar, if any, is ready)."""
        if fork.is_fork_parent(request) and request.num_prompt_tokens == 1:
            if fork.is_remote_decode(request):
                raise ValueError("n > 1 needs a prompt of at least 2 tokens to prefill apart")
            fork.add_children(self, request, fork.make_children(request), 0)  # nothing to share
            return
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.n > 1:
            self.fork_parents[request.request_id] = request

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from any state (abort, error). Unknown ids and
        already finished requests are ignored, so this is idempotent."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        assert status.is_finished
        request_ids = self.forks.expand(request_ids)  # a parent id: every child too
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if rid in self.held_for_send:
                # The client is gone; nobody will use the peer's copy.
                del self.held_for_send[rid]
                if self.connector is not None:
                    self.connector.cancel_send(rid)
                self._release(req)
                continue
            if req.is_finished:  # aborted while its remote read is in flight
                continue
            prev = req.status
            req.status = status
            if prev == RequestStatus.RUNNING:
                self.running.remove(req)
                self.unseen_by_runner.discard(rid)
                self.finished_req_ids.append(rid)
            elif prev == RequestStatus.WAITING_FOR_FSM:
                structured_grammar.forget(self, req)
                continue
            elif prev == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # NIXL is writing into its blocks: free them when the read ends.
                if self.connector is not None:
                    self.connector.request_finished(req, self.kv.get_block_ids(rid))
                continue
            else:
                self.waiting.remove(req)
            self._free_finished(req)

    def _free_finished(self, req: Request) -> dict | None:
        """Free a finished request's blocks unless the connector holds them for
        a peer. Returns the connector's kv_transfer_params."""
        params = None
        delay = False
        if self.connector is not None:
            delay, params = self.connector.request_finished(
                req, self.kv.get_block_ids(req.request_id)
            )
        if delay:
            self.held_for_send[req.request_id] = req
        else:
            self._release(req)
        return params

    def _release(self, req: Request) -> None:
        if self.structured is not None:
            self.structured.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.n > 1:
            self.fork_parents.pop(req.request_id, None)
            self.forks.discard(req)

    # ---- scheduling ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        catch_up: dict[str, int] = {}  # draft model: positions its draft recomputes
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: list[str] = []
        threshold = cfg.long_prefill_token_threshold
        limits = policies.PrefillLimits(
            cfg.max_num_partial_prefills, cfg.max_long_partial_prefills, threshold
        )
        if self.waiting_for_fsm:
            structured_grammar.admit_ready(self)
        if cfg.policy == "priority" and self.waiting and self.running:
            preemption.preempt_for_arrival(self, preempted)
        num_arrival_preempted = len(preempted)
        policies.order_running(cfg.policy, self.running)

        # 1. running requests, oldest first (prefill-first: prefills first)
        spec = self.spec
        if spec is not None and not spec.begin_step(len(self.running)):
            spec = None
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens
            if req.num_output_placeholders and at_output_limit(req, cfg.max_model_len):
                i += 1  # its in-flight token is its last: never schedule past max_tokens
                continue
            if req.n > 1 and req.parent_id is None:
                num_new -= 1  # a fork parent stops before the last prompt token
                if num_new <= 0:
                    i += 1
                    continue
            if limits.active:
                if not limits.allows(num_new):
                    i += 1  # over this step's partial-prefill limits
                    continue
                limits.take(num_new)
            if threshold and num_new > threshold:
                num_new = threshold
            num_new = min(num_new, budget)
            num_catch_up = 0  # a draft model's positions recomputed (scheduler/drafting.py)
            if spec is not None and num_new == 1:
                num_new, num_catch_up = drafting.decode_step(self, spec, req, budget, i)
                if num_new == 0:  # a seeded request waiting for its draft: no token
                    budget -= drafting.catch_up_only(self, req, num_catch_up, catch_up, new_reqs)
                    i += 1
                    continue
            while True:
                new_block_ids = self.kv.allocate_slots(req, num_new)
                if new_block_ids is not None:
                    break
                victim = policies.pick_victim(cfg.policy, self.running)
                if self.running.index(victim) < i:
                    i -= 1
                if victim is not req and victim.request_id in catch_up:
                    budget += drafting.take_back(victim, catch_up, num_scheduled, new_reqs)
                if victim is not req and victim.request_id in num_scheduled:
                    # The victim was already scheduled this step: take it back.
                    budget += num_scheduled.pop(victim.request_id)
                    if limits.active:
                        limits.release(victim.num_tokens - victim.num_computed_tokens)
                    if victim.request_id in cached.req_ids:
                        j = cached.req_ids.index(victim.request_id)
                        del cached.req_ids[j], cached.new_block_ids[j]
                        del cached.num_computed_tokens[j]
                    else:
                        new_reqs[:] = [n for n in new_reqs if n.req_id != victim.request_id]
                preemption.preempt(self, victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if new_block_ids is None:  # preempted itself; nothing after it can run
                break
            num_scheduled[req.request_id] = num_new
            budget -= num_new + drafting.record(catch_up, req, num_catch_up)
            i += 1
            if req.request_id in self.unseen_by_runner:
                self.unseen_by_runner.discard(req.request_id)
                new_reqs.append(admission.new_request_data(self, req))
                continue
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(req.num_computed_tokens)

        # 2. waiting requests, unless the running ones had to preempt
        if len(preempted) == num_arrival_preempted:
            budget = admission.schedule_waiting(self, budget, num_scheduled, new_reqs, limits)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=drafting.scheduled_drafts(self, num_scheduled),
            draft_catch_up=catch_up,
        )
        self.finished_req_ids = []
        if self.pending_copies:
            out.copy_block_ids, self.pending_copies = self.pending_copies, []
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        # The runner computes what was scheduled: advance now, so the counts
        # always describe the KV that exists once this step ran. Prompt tokens
        # are counted here, so every chunk of a chunked prefill counts (not
        # only the first) and a preempted request's taken-back chunk does not.
        requests = self.requests
        for rid, n in num_scheduled.items():
            req = requests[rid]
            self.num_prompt_tokens += max(
                0, min(n, req.num_prompt_tokens - req.num_computed_tokens)
            )
            req.num_computed_tokens += n
        drafting.advance(self, num_scheduled, catch_up)
        if self.structured is not None and self.structured.matchers:
            out.grammar_bitmask = structured_grammar.bitmask(self, num_scheduled)
        return out

    # ---- results -----------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineOutputs:
        """Apply a step's tokens (``scheduler/outputs.py``)."""
        return outputs.update_from_output(self, scheduler_output, runner_output)

    def _computing(self, req: Request) -> bool:
        """Is a step that computes ``req`` still running? Never here: each
        step's output is applied before the next is scheduled
        (``scheduler/async_scheduler.py`` overlaps them)."""
        return False

    # ---- introspection -------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.waiting_for_remote or self.waiting_for_fsm)

    def has_work(self) -> bool:
        """The engine loop must keep stepping: requests to run, or transfers to poll."""
        return bool(
            self.has_unfinished_requests()
            or self.held_for_send
            or self.finished_req_ids
            or self.pending_outputs
            or (self.connector is not None and self.connector.has_pending_work())
        )

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting) — waiting includes requests waiting for remote KV."""
        num_waiting = len(self.waiting) + len(self.waiting_for_remote) + len(self.waiting_for_fsm)
        return len(self.running), num_waiting

    def num_blocks_held_for_transfer(self) -> int:
        return sum(len(self.kv.req_blocks.get(r, ())) for r in self.held_for_send)

    def make_stats(self) -> SchedulerStats:
        return integrity.make_stats(self)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def check_integrity(self, idle: bool = True) -> None:
        """Raise AssertionError on any inconsistency (``scheduler/integrity.py``)."""
        integrity.check_integrity(self, idle)
