"""Model runner: SchedulerOutput in, sampled tokens out.

It keeps its own copy of each request's tokens and block table, updated from
the scheduler's diffs, and flattens a step into one batch:

    requests     a (prefill chunk 3)   b (decode)   c (decode)
    input_ids    [a5 a6 a7]            [b9]         [c4]
    positions    [5 6 7]               [9]          [4]
    seq_lens     8                     10           5
    logits rows  a7 (if the chunk ends the prompt), b9, c4

On CPU (fp32), single-token queries and verifications of drafts that get a dense decode
row (``workers/runner/dense_decode.py``) come first, ordered by row, and the step's
metadata is a ``workers.runner.attention.SplitAttention``; the rest keep the order
above and go through the paged kernels.

A step is launched then finished (``launch`` / ``finish``): the loop thread
plans it (``workers/runner/step_batch.py``), the step stream runs its forward and
sampling, and ``finish`` reads the sampled tokens. The synchronous loop
(``execute``) finishes each step at once; the overlapped loop
(``workers/runner/async_step.py``) plans and launches the next step first.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tandem.kernels import AttentionMetadata
from tandem.kernels.metadata import host_to_device, list_to_device
from tandem.kernels.prefill_attention import use_sdpa_prefills
from tandem.scheduler.messages import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from tandem.wire.engine_protocol import Logprobs, SamplingParams
from tandem.workers.graphs.piecewise import PiecewiseGraphRunner
from tandem.workers.graphs.runner import DecodeGraphRunner
from tandem.workers.runner.async_step import StepHandle, StepResult, StepStream
from tandem.workers.runner.attention import SplitAttention, StepMetadata
from tandem.workers.runner.cpu_allocator import tune_malloc_for_inference
from tandem.workers.runner.dense_decode import DenseDecodeKV, DenseDecodeStep
from tandem.workers.runner.spec_step import SpecPlan, apply_result, verified_rows
from tandem.workers.runner.step_batch import PLACEHOLDER, Segment, StepPlan, flatten
from tandem.workers.sampling.grammar_mask import GrammarRows
from tandem.workers.sampling.prompt_logprobs import prompt_logprobs
from tandem.workers.sampling.sample_logprobs import DeviceLogprobs
from tandem.workers.sampling.sampler import Sampler
from tandem.workers.sampling.spec_verify import verify
from tandem.workers.sampling.state import SamplingExtras, uses_extras

# CPU only: bytes the dense decode copy of the KV may use (see workers/runner/dense_decode.py).
DEFAULT_DENSE_DECODE_BYTES = 1 << 30


class _ReqState:
    __slots__ = (
        "token_ids",
        "block_ids",
        "num_computed",
        "num_prompt",
        "params",
        "prompt_lps",
        "stream_key",
        "pending",
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


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        eos_token_id: int | None,
        *,
        connector: Any = None,  # kvtransfer.base.KVConnectorWorkerSide
        seed: int | None = 0,
        dense_decode_bytes: int | None = None,
        decode_graphs: DecodeGraphRunner | None = None,
        piecewise_graphs: PiecewiseGraphRunner | None = None,
        prefill_attention: str = "auto",
        overlap: bool = False,
    ) -> None:
        self.model = model
        # each step's device work: on a thread of its own when steps overlap on
        # CPU, else inline (workers/runner/async_step.py)
        self.stream = StepStream(threaded=overlap and kv_cache.device.type == "cpu")
        self.graphs = decode_graphs  # CUDA: decode-only steps replay a captured graph
        self.piecewise = piecewise_graphs  # CUDA: other steps replay pieces around attention
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.eos_token_id = eos_token_id
        self.connector = connector
        self.sampler = Sampler(seed)
        # prefix-free prefills through SDPA on their own K/V (kernels/prefill_attention.py)
        self.sdpa_prefills = use_sdpa_prefills(prefill_attention, self.device, kv_cache.dtype)
        self.requests: dict[str, _ReqState] = {}
        # penalties / logit bias / bad words of the requests that use them
        self.extras = SamplingExtras(model.vocab_size, self.device)
        if self.device.type == "cpu":
            tune_malloc_for_inference()
        # Dense decode rows: a CPU fast path (the Triton kernels read the paged cache directly).
        # fp32 only: its softmax runs in the cache dtype, unlike SDPA's fp32 accumulation.
        if dense_decode_bytes is None:
            on_cpu_fp32 = self.device.type == "cpu" and kv_cache.dtype == torch.float32
            dense_decode_bytes = DEFAULT_DENSE_DECODE_BYTES if on_cpu_fp32 else 0
        self.dense = None
        if dense_decode_bytes > 0:
            num_heads = model.config.num_attention_heads
            self.dense = DenseDecodeKV(kv_cache, num_heads, dense_decode_bytes)
        if connector is not None:
            connector.register_kv_caches(kv_cache)

    def close(self) -> None:
        self.stream.close()

    def release_idle_memory(self) -> None:
        """Called by the engine loop while it has nothing to run."""
        if self.dense is not None:
            self.dense.release_if_idle(time.monotonic())

    def _update_states(self, so: SchedulerOutput, plan: StepPlan) -> None:
        dense_release = plan.dense_release  # the step stream owns the dense rows
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self.requests.pop(rid, None)
            self.extras.remove(rid)
            dense_release.append(rid)
        for nr in so.scheduled_new_reqs:
            dense_release.append(nr.req_id)
            self.requests[nr.req_id] = _ReqState(
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

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it (the synchronous loop)."""
        return self.finish(self.launch(so))

    def launch(self, so: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        """Plan ``so`` on this (the loop) thread and start its device work on the step
        stream (``workers/runner/async_step.py``); return without waiting for it. ``prev``: the
        step launched before, still in flight (its sampled tokens feed this one). Every
        launched step must be passed to ``finish``, in launch order."""
        plan = StepPlan()
        self._update_states(so, plan)
        if prev is not None and self._needs_host_tokens(so):
            self.read_tokens(prev)  # penalties / bad words count the tokens on the host
        meta = so.kv_connector_metadata
        if self.connector is not None and meta is not None:
            if prev is not None and getattr(meta, "loads", True):
                self.read_tokens(prev)  # its KV writes end before a load lands in a freed block
            self.connector.start_load_kv(meta)
        handle = StepHandle(plan)
        self._plan(so, plan, handle, prev)
        handle.future = self.stream.submit(self._run_step, plan, prev)
        return handle

    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step and build its output (loop thread)."""
        plan = handle.plan
        result: StepResult = handle.future.result()
        tokens = self.read_tokens(handle)
        out = ModelRunnerOutput()
        if plan.req_ids:
            slots = [-1] * len(plan.req_ids)
            for k, i in enumerate(plan.sample_segments):
                slots[i] = k
            out.req_ids = plan.req_ids
            out.sampled_token_ids = [[tokens[k]] if k >= 0 else [] for k in slots]
            if result.logprobs is not None:  # copied with the tokens: host memory now
                logprobs = result.logprobs.build(tokens)
                out.logprobs = [
                    [logprobs[k]] if k >= 0 and logprobs[k] is not None else [] for k in slots
                ]
            if plan.spec is not None:
                self._finish_spec(plan, result, out)
            for i in plan.sample_segments:
                prompt = plan.segments[i].prompt
                if prompt is not None:  # the prompt is done: its logprobs go out now
                    if out.prompt_logprobs is None:
                        out.prompt_logprobs = {}
                    out.prompt_logprobs[plan.req_ids[i]] = prompt[2]
        if self.connector is not None:
            sending, recving = self.connector.get_finished()
            invalid = self.connector.get_block_ids_with_load_errors()
            if sending or recving or invalid:
                out.kv_connector_output = KVConnectorOutput(
                    finished_sending=sorted(sending),
                    finished_recving=sorted(recving),
                    invalid_block_ids=sorted(invalid),
                )
        return out

    def _finish_spec(self, plan: StepPlan, result: StepResult, out: ModelRunnerOutput) -> None:
        """Speculative rows: their accepted tokens (and logprobs) into ``out``, and into
        the runner's copy of each request (``workers/runner/spec_step.py``)."""
        spec, verified = plan.spec, result.spec
        apply_result(spec, verified, self.block_size)
        if verified.logprobs is not None and out.logprobs is None:
            out.logprobs = [[] for _ in plan.req_ids]
        for k, i in enumerate(spec.segments):
            out.sampled_token_ids[i] = verified.token_ids[k]
            if verified.logprobs is not None:
                out.logprobs[i] = verified.logprobs[k]

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
        sampled: list[_ReqState] = []
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

    @torch.inference_mode()
    def _run_step(self, plan: StepPlan, prev: StepHandle | None) -> StepResult:
        """Device half of a step (step stream): layout, forward, sample. Reads only the
        plan, the dense rows and the previous step's result."""
        if self.dense is not None:
            for rid in plan.dense_release:
                self.dense.release(rid)
        if plan.copy_block_ids:  # a fork's partial last block, before anything writes
            src, dst = zip(*plan.copy_block_ids)
            # index tensors through pinned memory: a torch.tensor(..., device=cuda) would
            # be a hidden host wait for every kernel queued (kernels/metadata.py)
            src_t = list_to_device(src, self.device, torch.long)
            self.kv_cache[list_to_device(dst, self.device, torch.long)] = self.kv_cache[src_t]
        if not plan.segments:
            return StepResult()
        order, dense_step = self._order_for_dense(plan.segments, plan.spec)
        flat = flatten(plan.segments, order)
        dev = self.device
        scatter = None
        if flat.scatter_dst:
            prev_sampled = prev.future.result().sampled  # done: the stream runs in order
            src = host_to_device(torch.tensor(flat.scatter_src, dtype=torch.long), dev)
            dst = host_to_device(torch.tensor(flat.scatter_dst, dtype=torch.long), dev)

            def scatter(ids: torch.Tensor) -> None:
                ids.index_copy_(0, dst, prev_sampled.index_select(0, src).to(ids.dtype))

        hidden = None
        if self.graphs is not None and dense_step is None:
            hidden = self.graphs.run(
                flat.input_ids, flat.positions, flat.block_tables, flat.seq_lens, scatter
            )
        if hidden is None and self.piecewise is not None and dense_step is None:
            hidden = self.piecewise.run(
                flat.input_ids,
                flat.positions,
                flat.block_tables,
                flat.seq_lens,
                flat.query_lens,
                scatter,
            )
        if hidden is None:  # eager: no graph for this step (mode, bucket), CPU
            meta = self._metadata(
                flat.block_tables, flat.seq_lens, flat.query_lens, flat.positions, dense_step
            )
            ids_t = host_to_device(torch.tensor(flat.input_ids, dtype=torch.long), dev)
            if scatter is not None:
                scatter(ids_t)
            pos_t = host_to_device(torch.tensor(flat.positions, dtype=torch.long), dev)
            hidden = self.model(ids_t, pos_t, self.kv_cache, meta)
        for i, seg in enumerate(plan.segments):
            if seg.prompt is not None and seg.prompt[0]:
                targets, num_top, collected = seg.prompt
                first = flat.first_row[i]
                rows = hidden[first : first + len(targets)]
                collected.extend(prompt_logprobs(rows, self.model.compute_logits, targets, num_top))
        sample_rows = [flat.last_row[i] for i in plan.sample_segments]
        spec = None
        if plan.spec is not None:
            # one pass over the LM head for the sampled and the verified rows
            rows = sample_rows + verified_rows(plan.spec, flat.first_row, flat.last_row)
            logits = self.model.compute_logits(
                hidden.index_select(0, host_to_device(torch.tensor(rows), dev))
            )
            num = len(sample_rows)
            spec = verify(logits[num:], plan.spec.requests, self.eos_token_id, plan.spec.grammar)
            if not num:
                return StepResult(spec=spec)
            logits = logits[:num]
        elif not plan.sample_segments:
            return StepResult()
        elif sample_rows == list(range(len(hidden))):
            logits = self.model.compute_logits(hidden)  # decode-only: every row, in order
        else:
            last = hidden.index_select(0, host_to_device(torch.tensor(sample_rows), dev))
            logits = self.model.compute_logits(last)
        sampled, raw_logits = self.sampler.sample_on_device(
            logits,
            plan.params,
            plan.positions,
            plan.output_counts,
            [self.eos_token_id] * len(plan.params),
            plan.extras,
            plan.stream_keys,
            plan.grammar,
        )
        logprobs = DeviceLogprobs(raw_logits, plan.params, sampled) if plan.wants_logprobs else None
        return StepResult(sampled, logprobs, spec)

    def _order_for_dense(
        self, segments: list[Segment], spec: SpecPlan | None
    ) -> tuple[list[int], DenseDecodeStep | None]:
        """Flat order (indices into ``segments``): decodes (and verifications of drafts) on
        the dense path first (by row), then the rest. Step stream only (it owns the dense
        rows)."""
        everything = list(range(len(segments)))
        if self.dense is None:
            return everything, None
        decodes, decode_segments = [], []
        verified = set(spec.segments) if spec is not None else ()
        for i, seg in enumerate(segments):
            if seg.num_tokens == 1:
                decodes.append((seg.req_id, seg.start, seg.block_ids))
                decode_segments.append(i)
            elif i in verified:
                decodes.append((seg.req_id, seg.start, seg.block_ids, seg.num_tokens))
                decode_segments.append(i)
            else:
                self.dense.release(seg.req_id)  # its KV is being (re)computed: stale row
        chosen, step = self.dense.prepare(decodes)
        if step is None:
            return everything, None
        first = [decode_segments[j] for j in chosen]
        taken = set(first)
        return first + [i for i in everything if i not in taken], step

    def _metadata(
        self,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        positions: list[int],
        dense_step: DenseDecodeStep | None,
    ) -> StepMetadata:
        dev, bs = self.device, self.block_size
        if dense_step is None:
            meta = AttentionMetadata.build(block_tables, seq_lens, query_lens, bs, dev)
            meta.sdpa_prefills = self.sdpa_prefills
            return meta
        n = dense_step.num_segments  # the first n segments, dense_step.num_tokens tokens
        dense_slots = []
        token = 0
        for table, num in zip(block_tables[:n], query_lens[:n]):
            for pos in positions[token : token + num]:
                dense_slots.append(table[pos // bs] * bs + pos % bs)
            token += num
        paged = None
        slot_mapping = list_to_device(dense_slots, dev, torch.long)
        if len(block_tables) > n:
            paged = AttentionMetadata.build(block_tables[n:], seq_lens[n:], query_lens[n:], bs, dev)
            paged.sdpa_prefills = self.sdpa_prefills
            slot_mapping = torch.cat((slot_mapping, paged.slot_mapping.long()))
        return SplitAttention(slot_mapping, dense_step, paged)
