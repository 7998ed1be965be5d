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

import time
from collections.abc import Iterable

from tandem.scheduler import fork, policies, structured_grammar
from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.kv_cache_manager import KVCacheManager, cdiv
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
        if request.request_id in self.requests or request.request_id in self.forks.children:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not isinstance(request.n, int) or not 1 <= request.n <= fork.MAX_N:
            raise ValueError(f"n must be an integer in [1, {fork.MAX_N}], got {request.n!r}")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {request.num_prompt_tokens} tokens; it must be shorter "
                f"than max_model_len ({self.config.max_model_len})"
            )
        salt = request.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string when given, got {salt!r}")
        request.sampling_params.validate()
        if request.sampling_params.structured_outputs is not None:
            structured_grammar.wait_for_grammar(self, request)
            return
        self._admit(request)

    def _admit(self, request: Request) -> None:
        """Queue a validated request (whose grammar, if any, is ready)."""
        if fork.is_fork_parent(request) and request.num_prompt_tokens == 1:
            if fork.is_remote_decode(request):
                raise ValueError("n > 1 needs a prompt of at least 2 tokens to prefill apart")
            self._add_children(request, fork.make_children(request), 0)  # nothing to share
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
            self._preempt_for_arrival(preempted)
        num_arrival_preempted = len(preempted)
        policies.order_running(cfg.policy, self.running)

        # 1. running requests, oldest first (prefill-first: prefills first)
        spec = self.spec if self.spec is not None and self.spec.active(len(self.running)) else None
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
            if (
                spec is not None
                and num_new == 1
                and req.num_computed_tokens == req.num_tokens - 1
                and not req.num_output_placeholders
            ):
                num_new += len(spec.draft(req, budget - 1, cfg.max_model_len))
            while True:
                new_block_ids = self.kv.allocate_slots(req, num_new)
                if new_block_ids is not None:
                    break
                victim = policies.pick_victim(cfg.policy, self.running)
                if self.running.index(victim) < i:
                    i -= 1
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
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if new_block_ids is None:  # preempted itself; nothing after it can run
                break
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1
            if req.request_id in self.unseen_by_runner:
                self.unseen_by_runner.discard(req.request_id)
                new_reqs.append(self._new_request_data(req))
                continue
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(req.num_computed_tokens)

        # 2. waiting requests, unless the running ones had to preempt
        if len(preempted) == num_arrival_preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs, limits)

        spec_tokens = {}
        if self.spec is not None:
            requests = self.requests
            for rid in num_scheduled:
                drafts = requests[rid].spec_token_ids
                if drafts:
                    spec_tokens[rid] = drafts
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=spec_tokens,
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
        if self.structured is not None and self.structured.matchers:
            out.grammar_bitmask = structured_grammar.bitmask(self, num_scheduled)
        return out

    def _schedule_waiting(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        limits: policies.PrefillLimits,
    ) -> int:
        cfg = self.config
        connector = self.connector
        threshold = cfg.long_prefill_token_threshold
        skipped: list[Request] = []
        # Requests waiting for remote KV count against max_num_seqs: they join
        # the running set as soon as their KV lands.
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.waiting_for_remote) < cfg.max_num_seqs
        ):
            req = self.waiting.peek()
            computed_blocks = None
            num_new_computed = 0
            num_external = 0
            load_async = False
            if req.num_computed_tokens == 0:
                computed_blocks, num_new_computed = self.kv.get_computed_blocks(req)
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
                    self.waiting.pop()  # a long prompt at its limit: shorter ones overtake
                    skipped.append(req)
                    continue
                if threshold and num_new > threshold:
                    num_new = threshold
                if num_new > budget and not cfg.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
            if self.margin_blocks and not self._room_after_margin(
                num_computed + num_new, computed_blocks
            ):
                break  # admitting it would eat into the blocks kept for growth
            new_block_ids = self.kv.allocate_slots(
                req,
                num_new + num_external,
                num_new_computed,
                computed_blocks,
                delay_cache_blocks=load_async,
            )
            if new_block_ids is None:
                break  # no room; it keeps its place at the head of the queue
            self.waiting.pop()
            if req.num_computed_tokens == 0:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_new_computed
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_new_computed
                    if num_external and self._own_tier_load(req):
                        req.num_cached_tokens += num_external  # the engine's own hit
            block_ids = self.kv.get_block_ids(req.request_id)
            if connector is not None:
                connector.update_state_after_alloc(req, block_ids, num_external)
            req.num_computed_tokens = num_computed
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.waiting_for_remote[req.request_id] = req
                continue
            if num_new == 0:
                if req.n > 1 and req.parent_id is None:
                    # a fork parent whose whole prefill was a prefix hit:
                    # update_from_output forks it
                    req.status = RequestStatus.RUNNING
                    self.running.append(req)
                    continue
                skipped.append(req)  # nothing fits this step
                continue
            if limits.active:
                limits.take(req.num_tokens - num_computed)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            new_reqs.append(self._new_request_data(req))
        if skipped:
            self.waiting.prepend_all(skipped)
        return budget

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req_id=req.request_id,
            all_token_ids=list(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            sampling_params=req.sampling_params,
            block_ids=self.kv.get_block_ids(req.request_id),
            num_computed_tokens=req.num_computed_tokens,
        )

    def _room_after_margin(self, num_tokens: int, computed_blocks) -> bool:
        """Would a waiting request holding ``num_tokens`` tokens leave the
        admission margin free? Always yes for a lone request."""
        if not self.running and not self.waiting_for_remote:
            return True
        hits = computed_blocks or ()
        num_taken = cdiv(num_tokens, self.config.block_size) - len(hits)
        num_taken += sum(1 for b in hits if b.ref_cnt == 0)  # revived from the free queue
        return self.kv.num_free_blocks - num_taken >= self.margin_blocks

    def _preempt_for_arrival(self, preempted: list[str]) -> None:
        """Priority policy: preempt running requests with a larger priority
        value until the best waiting request could be admitted."""
        cfg = self.config
        head = self.waiting.peek()
        num_first = min(head.num_tokens - head.num_computed_tokens, cfg.max_num_batched_tokens)
        if cfg.long_prefill_token_threshold:
            num_first = min(num_first, cfg.long_prefill_token_threshold)
        num_blocks = cdiv(head.num_computed_tokens + num_first, cfg.block_size) + self.margin_blocks
        while (
            len(self.running) + len(self.waiting_for_remote) >= cfg.max_num_seqs
            or self.kv.num_free_blocks < num_blocks
        ):
            victim = policies.arrival_victim(self.running, head)
            if victim is None:
                return
            self._preempt(victim)
            preempted.append(victim.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.unseen_by_runner.discard(req.request_id)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # an in-flight token is dropped and recomputed
        req.spec_token_ids = []  # its drafts are dropped with its blocks
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    # ---- results -----------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineOutputs:
        outputs = self.pending_outputs
        self.pending_outputs = []
        if runner_output.kv_connector_output is not None:
            self._update_kv_transfers(runner_output.kv_connector_output, outputs)
        if self.fork_parents:
            self._fork_ready_parents(outputs)
        logprobs = runner_output.logprobs
        requests = self.requests
        cfg_max_len = self.config.max_model_len
        for idx, (rid, token_ids) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        ):
            if not token_ids:
                continue  # partial prefill chunk
            req = requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            if req.spec_token_ids:
                self.spec.accept(req, len(token_ids))  # rejected drafts' slots back
            status = None
            if len(token_ids) == 1:
                req.all_token_ids.append(token_ids[0])
                status = self._check_stop(req, token_ids[0], cfg_max_len)
                new_tokens = token_ids
            else:
                new_tokens = []
                for tok in token_ids:
                    req.all_token_ids.append(tok)
                    new_tokens.append(tok)
                    status = self._check_stop(req, tok, cfg_max_len)
                    if status is not None:
                        break
            if req.sampling_params.structured_outputs is not None:
                status = structured_grammar.advance(self, req, new_tokens, status)
            self.num_generation_tokens += len(new_tokens)
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
                self.running.remove(req)
                self.finished_req_ids.append(rid)
                out.kv_transfer_params = self._free_finished(req)
            outputs.append(out)
        return EngineOutputs(engine_id=self.engine_id, outputs=outputs, timestamp=time.time())

    def _fork_ready_parents(self, outputs: list[EngineOutput]) -> None:
        """Fork every running parent whose prompt but its last token is computed."""
        for parent in list(self.fork_parents.values()):
            if (
                parent.status == RequestStatus.RUNNING
                and parent.num_computed_tokens == parent.num_tokens - 1
                and not self._computing(parent)
            ):
                self._fork(parent, outputs)

    def _computing(self, req: Request) -> bool:
        """Is a step that computes ``req`` still running? Never here: each
        step's output is applied before the next is scheduled
        (``scheduler/async_scheduler.py`` overlaps them)."""
        return False

    def _fork(self, parent: Request, outputs: list[EngineOutput]) -> None:
        pid = parent.request_id
        del self.fork_parents[pid]
        self.running.remove(parent)
        self.unseen_by_runner.discard(pid)
        self.finished_req_ids.append(pid)
        if fork.is_remote_decode(parent):
            # P: hand the shared KV off; the decode engine forks
            parent.status = RequestStatus.FINISHED_LENGTH_CAPPED
            out = EngineOutput(
                request_id=pid,
                finish_reason=parent.status.finish_reason,
                num_cached_tokens=max(parent.num_cached_tokens, 0),
            )
            out.kv_transfer_params = self._free_finished(parent)
            outputs.append(out)
            return
        if self.connector is not None:  # D: forget the parent's remote-load state
            self.connector.request_finished(parent, self.kv.get_block_ids(pid))
        self.requests.pop(pid)
        if self.structured is not None:
            self.structured.remove(parent)  # each child gets its own matcher
        children = fork.make_children(parent)
        num_slots = self.config.max_num_seqs - len(self.running) - len(self.waiting_for_remote)
        num_forked, copies = fork.fork_blocks(self.kv, parent, children, max(1, num_slots))
        self.pending_copies.extend(copies)
        self._add_children(parent, children, num_forked)

    def _add_children(self, parent: Request, children: list[Request], num_forked: int) -> None:
        """Track the children: the first ``num_forked`` hold the parent's KV and
        run; the rest start as new requests ahead of other waiting ones."""
        self.forks.add(parent.request_id, children)
        constrained = parent.sampling_params.structured_outputs is not None
        for child in children:
            child.n = parent.n
            self.requests[child.request_id] = child
            if constrained:
                self.structured.matcher_for(child)  # from the cached grammar
        for child in children[:num_forked]:
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self.unseen_by_runner.add(child.request_id)
        for child in children[num_forked:]:
            fork.start_waiting(child)
        self.waiting.prepend_all(children[num_forked:])

    @staticmethod
    def _check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
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

    def _update_kv_transfers(self, kv_out, outputs: list[EngineOutput]) -> None:
        if self.connector is not None:
            self.connector.update_connector_output(kv_out)
        invalid = set(kv_out.invalid_block_ids)
        for rid in kv_out.finished_recving:
            req = self.waiting_for_remote.pop(rid, None)
            if req is None:
                continue
            if req.is_finished:  # aborted during the read: blocks are safe to free now
                self._release(req)
                continue
            self._finish_remote_load(req, invalid, outputs)
        for rid in kv_out.finished_sending:
            req = self.held_for_send.pop(rid, None)
            if req is not None:
                self._release(req)

    def _finish_remote_load(
        self, req: Request, invalid: set[int], outputs: list[EngineOutput]
    ) -> None:
        block_ids = self.kv.get_block_ids(req.request_id)
        bad = [i for i, b in enumerate(block_ids) if b in invalid]
        if bad:
            tier_load = self._own_tier_load(req)  # always recomputed
            if self.config.load_failure_policy == "fail" and not tier_load:
                req.status = RequestStatus.FINISHED_ERROR
                req.error = "remote KV load failed"
                self._release(req)
                outputs.append(
                    EngineOutput(
                        request_id=req.request_id,
                        finish_reason=req.status.finish_reason,
                        error=req.error,
                    )
                )
                return
            # Recompute from the first bad block on; earlier blocks are good.
            req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * self.config.block_size)
            if tier_load:
                req.num_cached_tokens = min(req.num_cached_tokens, req.num_computed_tokens)
            self.kv.truncate_computed(req, req.num_computed_tokens)
        # The KV is in place: publish the filled blocks for prefix hits and
        # stop treating the request as remote (a later preemption recomputes).
        # It joins the running set directly: it holds blocks, so it must be
        # preemptable like any running request (a waiting request holding
        # blocks could deadlock the pool).
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.kv_transfer_params = None
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        self.running.append(req)
        self.unseen_by_runner.add(req.request_id)

    def _own_tier_load(self, req: Request) -> bool:
        """KV tiers (kvtransfer/tiers/): is req's load from this engine's own tiers
        rather than a peer? Its tokens are cached tokens, its bad blocks recomputed."""
        own = getattr(self.connector, "loads_from_own_tiers", None)
        return own is not None and own(req)

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
        stats = self._make_stats()
        if self.spec is not None:
            self.spec.stats.fill(stats)
        return stats

    def _make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_fsm),
            num_waiting_for_remote_kvs=len(self.waiting_for_remote),
            kv_cache_usage=self.kv.usage(),
            num_blocks_held_for_transfer=self.num_blocks_held_for_transfer(),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def check_integrity(self, idle: bool = True) -> None:
        """Raise AssertionError on any inconsistency. With ``idle`` (default),
        also require that nothing is tracked and every block is free."""
        self.kv.check_integrity()
        tracked = (
            {r.request_id for r in self.running}
            | {r.request_id for r in self.waiting}
            | set(self.waiting_for_remote)
            | set(self.waiting_for_fsm)
            | set(self.held_for_send)
        )
        assert tracked == set(self.requests), (
            f"orphaned requests: {sorted(set(self.requests) ^ tracked)}"
        )
        assert len(self.running) <= self.config.max_num_seqs
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, r
        for rid in self.kv.req_blocks:
            assert rid in self.requests, f"blocks held by unknown request {rid}"
        self.forks.check_integrity(self.requests)
        structured_grammar.check_integrity(self)
        if self.spec is not None:  # between steps: every draft verified, its slot back
            for r in self.running:
                assert not r.spec_token_ids, f"{r.request_id}: unverified drafts"
                num_blocks = len(self.kv.req_blocks.get(r.request_id, ()))
                assert num_blocks <= cdiv(r.num_computed_tokens, self.config.block_size), (
                    f"{r.request_id}: {num_blocks} blocks for {r.num_computed_tokens} tokens"
                )
        for rid, parent in self.fork_parents.items():
            assert self.requests.get(rid) is parent, f"fork parent {rid} is not tracked"
        if idle:
            assert not self.requests, f"requests still tracked: {sorted(self.requests)}"
            assert self.kv.num_free_blocks == self.config.num_kv_blocks, (
                f"{self.config.num_kv_blocks - self.kv.num_free_blocks} blocks leaked"
            )
