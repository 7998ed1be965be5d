"""Model runner: SchedulerOutput in, sampled tokens out.

It keeps its own copy of each request's tokens and block table, updated from
the scheduler's diffs, and flattens a step into one batch:

    requests     a (prefill chunk 3)   b (decode)   c (decode)
    input_ids    [a5 a6 a7]            [b9]         [c4]
    positions    [5 6 7]               [9]          [4]
    seq_lens     8                     10           5
    logits rows  a7 (if the chunk ends the prompt), b9, c4

On CPU (fp32), single-token queries that get a dense decode row
(``workers/dense_decode.py``) come first, ordered by row, and the step's
metadata is a ``workers.attention.SplitAttention``; the rest keep the order
above and go through the paged kernels.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kernels import AttentionMetadata
from kernels.metadata import host_to_device
from kernels.prefill_attention import use_sdpa_prefills
from scheduler.messages import (
    KVConnectorOutput,
    Logprobs,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from workers.attention import SplitAttention, StepMetadata
from workers.cpu_allocator import tune_malloc_for_inference
from workers.dense_decode import DenseDecodeKV, DenseDecodeStep
from workers.graphs.piecewise import PiecewiseGraphRunner
from workers.graphs.runner import DecodeGraphRunner
from workers.sampler import Sampler
from workers.sampling.prompt_logprobs import prompt_logprobs
from workers.sampling.state import SamplingExtras

# CPU only: bytes the dense decode copy of the KV may use (see workers/dense_decode.py).
DEFAULT_DENSE_DECODE_BYTES = 1 << 30


class _ReqState:
    __slots__ = ("token_ids", "block_ids", "num_computed", "num_prompt", "params", "prompt_lps")

    def __init__(
        self, token_ids: list[int], block_ids: list[int], num_computed: int, num_prompt: int, params
    ) -> None:
        self.token_ids = token_ids
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.num_prompt = num_prompt
        self.params: SamplingParams = params
        # prompt logprobs collected chunk by chunk until the first token is sampled
        self.prompt_lps: list[Logprobs] | None = None
        if params.prompt_logprobs is not None and num_computed == 0:
            self.prompt_lps = [] if len(token_ids) == num_prompt else None


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
    ) -> None:
        self.model = model
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

    def release_idle_memory(self) -> None:
        """Called by the engine loop while it has nothing to run."""
        if self.dense is not None:
            self.dense.release_if_idle(time.monotonic())

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self.requests.pop(rid, None)
            self.extras.remove(rid)
            if self.dense is not None:
                self.dense.release(rid)
        for nr in so.scheduled_new_reqs:
            if self.dense is not None:
                self.dense.release(nr.req_id)
            self.requests[nr.req_id] = _ReqState(
                list(nr.all_token_ids),
                list(nr.block_ids),
                nr.num_computed_tokens,
                nr.num_prompt_tokens,
                nr.sampling_params,
            )
            self.extras.add(nr.req_id, nr.sampling_params, nr.all_token_ids, nr.num_prompt_tokens)
        c = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.requests[rid]
            if new_blocks:
                st.block_ids.extend(new_blocks)
            st.num_computed = num_computed

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.copy_block_ids:  # a fork's partial last block, before anything writes
            src, dst = zip(*so.copy_block_ids)
            dev = self.device
            self.kv_cache[torch.tensor(dst, device=dev)] = self.kv_cache[
                torch.tensor(src, device=dev)
            ]
        if self.connector is not None and so.kv_connector_metadata is not None:
            self.connector.start_load_kv(so.kv_connector_metadata)
        out = ModelRunnerOutput()
        if so.total_num_scheduled_tokens > 0:
            self._forward_and_sample(so, out)
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

    def _forward_and_sample(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        req_ids = list(so.num_scheduled_tokens)
        order, dense_step = self._order_for_dense(so, req_ids)
        input_ids: list[int] = []
        positions: list[int] = []
        block_tables, seq_lens, query_lens = [], [], []
        sample_rows: list[int] = []  # flat index of each sampled token's last query token
        sample_reqs: list[_ReqState] = []
        sample_ids: list[str] = []
        sampled_slot: dict[str, int] = {}  # req id -> index into sample_reqs
        # requests collecting prompt logprobs: (id, state, flat row of start, start, stop)
        prompt_chunks: list[tuple[str, _ReqState, int, int, int]] = []
        for rid in order:
            n = so.num_scheduled_tokens[rid]
            st = self.requests[rid]
            start = st.num_computed
            end = start + n
            if n == 1:
                input_ids.append(st.token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(st.token_ids[start:end])
                positions.extend(range(start, end))
            if st.prompt_lps is not None:
                stop = max(start, min(end, st.num_prompt - 1))
                prompt_chunks.append((rid, st, len(input_ids) - n, start, stop))
            block_tables.append(st.block_ids)
            seq_lens.append(end)
            query_lens.append(n)
            st.num_computed = end
            if end == len(st.token_ids):
                sampled_slot[rid] = len(sample_reqs)
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(st)
                sample_ids.append(rid)
        dev = self.device
        hidden = None
        if self.graphs is not None and dense_step is None:
            hidden = self.graphs.run(input_ids, positions, block_tables, seq_lens)
        if hidden is None and self.piecewise is not None and dense_step is None:
            hidden = self.piecewise.run(input_ids, positions, block_tables, seq_lens, query_lens)
        if hidden is None:  # eager: no graph for this step (mode, bucket), CPU
            meta = self._metadata(block_tables, seq_lens, query_lens, positions, dense_step)
            ids_t = host_to_device(torch.tensor(input_ids, dtype=torch.long), dev)
            pos_t = host_to_device(torch.tensor(positions, dtype=torch.long), dev)
            hidden = self.model(ids_t, pos_t, self.kv_cache, meta)
        for _, st, flat, start, stop in prompt_chunks:
            if stop > start:
                rows = hidden[flat : flat + stop - start]
                targets = st.token_ids[start + 1 : stop + 1]
                num_top = st.params.prompt_logprobs or 0
                lps = prompt_logprobs(rows, self.model.compute_logits, targets, num_top)
                st.prompt_lps.extend(lps)
        tokens: list[int] = []
        logprobs = None
        if sample_reqs:
            if sample_rows == list(range(len(hidden))):
                last = hidden  # decode-only step: every row is sampled, in order
            else:
                rows = host_to_device(torch.tensor(sample_rows, dtype=torch.long), dev)
                last = hidden.index_select(0, rows)
            logits = self.model.compute_logits(last)
            extras = None
            if self.extras.num_tracked:
                histories = [(st.token_ids, st.num_prompt) for st in sample_reqs]
                extras = self.extras.batch(sample_ids, histories)
            tokens, logprobs = self.sampler.sample(
                logits,
                [st.params for st in sample_reqs],
                [len(st.token_ids) for st in sample_reqs],
                [len(st.token_ids) - st.num_prompt for st in sample_reqs],
                [self.eos_token_id] * len(sample_reqs),
                extras,
            )
            for st, tok in zip(sample_reqs, tokens):
                st.token_ids.append(tok)
            self.extras.record(sample_ids, tokens)
        for rid, st, _, _, _ in prompt_chunks:
            if rid in sampled_slot:  # the prompt is done: its logprobs go out now
                if out.prompt_logprobs is None:
                    out.prompt_logprobs = {}
                out.prompt_logprobs[rid] = st.prompt_lps
                st.prompt_lps = None
        slots = [sampled_slot.get(rid, -1) for rid in req_ids]
        out.req_ids = req_ids
        out.sampled_token_ids = [[tokens[k]] if k >= 0 else [] for k in slots]
        if logprobs is not None:
            out.logprobs = [
                [logprobs[k]] if k >= 0 and logprobs[k] is not None else [] for k in slots
            ]

    def _order_for_dense(
        self, so: SchedulerOutput, req_ids: list[str]
    ) -> tuple[list[str], DenseDecodeStep | None]:
        """Flat token order: decodes on the dense path first (by row), then the rest."""
        if self.dense is None:
            return req_ids, None
        decodes = []
        for rid in req_ids:
            st = self.requests[rid]
            if so.num_scheduled_tokens[rid] == 1:
                decodes.append((rid, st.num_computed, st.block_ids))
            else:
                self.dense.release(rid)  # its KV is being (re)computed: the row would be stale
        chosen, step = self.dense.prepare(decodes)
        if step is None:
            return req_ids, None
        first = [decodes[i][0] for i in chosen]
        taken = set(first)
        return first + [rid for rid in req_ids if rid not in taken], step

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
        n = dense_step.num_tokens
        dense_slots = [
            table[pos // bs] * bs + pos % bs for table, pos in zip(block_tables[:n], positions)
        ]
        paged = None
        slot_mapping = torch.tensor(dense_slots, dtype=torch.long, device=dev)
        if len(block_tables) > n:
            paged = AttentionMetadata.build(block_tables[n:], seq_lens[n:], query_lens[n:], bs, dev)
            paged.sdpa_prefills = self.sdpa_prefills
            slot_mapping = torch.cat((slot_mapping, paged.slot_mapping.long()))
        return SplitAttention(slot_mapping, dense_step, paged)
