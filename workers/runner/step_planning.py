"""The model runner's host half of a step (loop thread): its copy of each request,
updated from the scheduler's diffs, and each step's plan (``workers/runner/step_batch.py``):
segments, sampling inputs, a PLACEHOLDER for every token the step samples, and reading
the sampled tokens back into the copies."""

from __future__ import annotations

from typing import Any

from tandem.scheduler.messages import SchedulerOutput
from tandem.wire.engine_protocol import Logprobs, SamplingParams
from tandem.workers.runner.async_step import StepHandle, StepResult
from tandem.workers.runner.spec_step import SpecPlan
from tandem.workers.runner.step_batch import PLACEHOLDER, Segment, StepPlan
from tandem.workers.sampling.grammar_mask import GrammarRows
from tandem.workers.sampling.state import SamplingExtras, uses_extras


class ReqState:
    __slots__ = (
        "token_ids",
        "block_ids",
        "num_computed",
        "num_prompt",
        "params",
        "prompt_lps",
        "stream_key",
        "pending",
        "draft_computed",
    )

    def __init__(
        self,
        token_ids: list[int],
        block_ids: list[int],
        num_computed: int,
        num_prompt: int,
        params,
        stream_key: int,
    ) -> None:
        self.token_ids = token_ids  # PLACEHOLDER where a step in flight samples
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.num_prompt = num_prompt
        self.params: SamplingParams = params
        # prompt logprobs collected chunk by chunk until the first token is sampled
        self.prompt_lps: list[Logprobs] | None = None
        if params.prompt_logprobs is not None and num_computed == 0:
            self.prompt_lps = [] if len(token_ids) == num_prompt else None
        self.stream_key = stream_key  # keys an unseeded request's random draws
        # (launched step, its sampled row) of the PLACEHOLDER at the end of token_ids
        self.pending: tuple[StepHandle, int] | None = None
        # draft model (workers/spec/draft_model.py): positions whose draft KV is valid;
        # 0 for every new copy, whatever computed the target's KV
        self.draft_computed = 0


class StepPlanning:
    """ModelRunner's planning half (a mixin: its state is the runner's)."""

    requests: dict[str, ReqState]
    extras: SamplingExtras
    sampler: Any
    block_size: int

    def _update_states(self, so: SchedulerOutput, plan: StepPlan) -> None:
        dense_release = plan.dense_release  # the step stream owns the dense rows
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self.requests.pop(rid, None)
            self.extras.remove(rid)
            dense_release.append(rid)
        for nr in so.scheduled_new_reqs:
            dense_release.append(nr.req_id)
            self.requests[nr.req_id] = ReqState(
                list(nr.all_token_ids),
                list(nr.block_ids),
                nr.num_computed_tokens,
                nr.num_prompt_tokens,
                nr.sampling_params,
                self.sampler.stream_key(nr.req_id),
            )
            self.extras.add(nr.req_id, nr.sampling_params, nr.all_token_ids, nr.num_prompt_tokens)
        c = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.requests[rid]
            if new_blocks:
                st.block_ids.extend(new_blocks)
            st.num_computed = num_computed

    def read_tokens(self, handle: StepHandle) -> list[int]:
        """A launched step's sampled tokens on the host (the step's one device->host
        sync; waits for it). Fills the requests' placeholders; idempotent."""
        if handle.tokens is not None:
            return handle.tokens
        result: StepResult = handle.future.result()
        tokens = result.token_list()
        plan = handle.plan
        counted_ids, counted = [], []  # for the penalties: rows of requests still here
        for (st, index), token, i in zip(handle.sample_states, tokens, plan.sample_segments,
                                         strict=True):  # fmt: skip
            st.token_ids[index] = token
            if st.pending is not None and st.pending[0] is handle:
                st.pending = None
            rid = plan.req_ids[i]
            if self.requests.get(rid) is st:  # not finished, nor re-added since
                counted_ids.append(rid)
                counted.append(token)
        handle.tokens = tokens
        self.extras.record(counted_ids, counted)
        return tokens

    def _needs_host_tokens(self, so: SchedulerOutput) -> bool:
        """Does a request of ``so`` with a token in flight use penalties, logit bias or
        bad words? Those read its tokens on the host."""
        if not self.extras.num_tracked:
            return False
        for rid in so.num_scheduled_tokens:
            st = self.requests[rid]
            if st.pending is not None and uses_extras(st.params):
                return True
        return False

    def _plan(
        self, so: SchedulerOutput, plan: StepPlan, handle: StepHandle, prev: StepHandle | None
    ) -> None:
        """Host half of a step (loop thread): each request's segment, sampling inputs,
        and a PLACEHOLDER for every token this step samples."""
        plan.copy_block_ids = list(so.copy_block_ids)
        if so.total_num_scheduled_tokens == 0:
            return
        bs = self.block_size
        sampled: list[ReqState] = []
        spec_tokens = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests[rid]
            start = st.num_computed
            end = start + n
            drafts = spec_tokens.get(rid) if spec_tokens else None
            if drafts:  # last token + drafts, every position verified
                assert (
                    prev is None
                    and st.prompt_lps is None
                    and end == len(st.token_ids) + len(drafts)
                ), rid
                if plan.spec is None:
                    plan.spec = SpecPlan()
                plan.req_ids.append(rid)
                plan.segments.append(
                    Segment(rid, st.token_ids[start:] + drafts, start,
                            st.block_ids[: -(-end // bs)], -1, None)
                )  # fmt: skip
                plan.spec.add(len(plan.segments) - 1, st, drafts, st.stream_key)
                st.num_computed = end
                continue
            pending_row = -1
            if st.pending is not None:  # its last token is still on the device
                pending_handle, pending_row = st.pending
                assert pending_handle is prev and end == len(st.token_ids), rid
            prompt = None
            if st.prompt_lps is not None:
                stop = max(start, min(end, st.num_prompt - 1))
                targets = st.token_ids[start + 1 : stop + 1]
                prompt = (targets, st.params.prompt_logprobs or 0, st.prompt_lps)
            plan.req_ids.append(rid)
            plan.segments.append(
                Segment(rid, st.token_ids[start:end], start, st.block_ids[: -(-end // bs)],
                        pending_row, prompt)
            )  # fmt: skip
            st.num_computed = end
            if end == len(st.token_ids):
                plan.sample_segments.append(len(plan.segments) - 1)
                sampled.append(st)
                st.prompt_lps = None  # complete once this step ran: sent with its token
        if so.draft_catch_up:
            self._plan_catch_up(so, plan)
        if plan.spec is not None and so.grammar_bitmask is not None:
            plan.spec.take_grammar(so.grammar_bitmask, plan.req_ids)
        if not sampled:
            return
        plan.params = [st.params for st in sampled]
        plan.positions = [len(st.token_ids) for st in sampled]
        plan.output_counts = [len(st.token_ids) - st.num_prompt for st in sampled]
        plan.stream_keys = [st.stream_key for st in sampled]
        plan.wants_logprobs = any(p.logprobs is not None for p in plan.params)
        if so.grammar_bitmask is not None:
            sampled_ids = [plan.req_ids[i] for i in plan.sample_segments]
            plan.grammar = GrammarRows.from_step(so.grammar_bitmask, sampled_ids)
        if self.extras.num_tracked:
            histories = [(st.token_ids, st.num_prompt) for st in sampled]
            plan.extras = self.extras.batch([plan.req_ids[i] for i in plan.sample_segments],
                                            histories)  # fmt: skip
        for row, st in enumerate(sampled):
            handle.sample_states.append((st, len(st.token_ids)))
            st.token_ids.append(PLACEHOLDER)
            st.pending = (handle, row)

    def _plan_catch_up(self, so: SchedulerOutput, plan: StepPlan) -> None:
        """The draft model's catch-up queries of the requests that do not draft this step
        (``SchedulerOutput.draft_catch_up``; a drafting request's catch-up is its first
        draft forward's): positions ``draft_computed`` on, never past the target's
        computed tokens once this step ran (their slots are the request's)."""
        spec_tokens = so.scheduled_spec_decode_tokens
        bs = self.block_size
        for rid, num in so.draft_catch_up.items():
            if rid in spec_tokens:
                continue
            st = self.requests[rid]
            start = st.draft_computed
            end = min(start + num, st.num_computed)
            if end > start:
                blocks = st.block_ids[: -(-end // bs)]
                plan.draft_catch_up.append((st, rid, st.token_ids[start:end], start, blocks))
