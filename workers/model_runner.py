"""Model runner: SchedulerOutput in, sampled tokens out.

It keeps its own copy of each request's tokens and block table, updated from
the scheduler's diffs, and flattens a step into one batch:

    requests     a (prefill chunk 3)   b (decode)   c (decode)
    input_ids    [a5 a6 a7]            [b9]         [c4]
    positions    [5 6 7]               [9]          [4]
    seq_lens     8                     10           5
    logits rows  a7 (if the chunk ends the prompt), b9, c4
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import AttentionMetadata
from scheduler.messages import (
    KVConnectorOutput,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from workers.sampler import Sampler


class _ReqState:
    __slots__ = ("token_ids", "block_ids", "num_computed", "num_prompt", "params")

    def __init__(
        self, token_ids: list[int], block_ids: list[int], num_computed: int, num_prompt: int, params
    ) -> None:
        self.token_ids = token_ids
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.num_prompt = num_prompt
        self.params: SamplingParams = params


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
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.eos_token_id = eos_token_id
        self.connector = connector
        self.sampler = Sampler(seed)
        self.requests: dict[str, _ReqState] = {}
        if connector is not None:
            connector.register_kv_caches(kv_cache)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.requests[nr.req_id] = _ReqState(
                list(nr.all_token_ids),
                list(nr.block_ids),
                nr.num_computed_tokens,
                nr.num_prompt_tokens,
                nr.sampling_params,
            )
        c = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.requests[rid]
            if new_blocks:
                st.block_ids.extend(new_blocks)
            st.num_computed = num_computed

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
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
        input_ids: list[int] = []
        positions: list[int] = []
        block_tables, seq_lens, query_lens = [], [], []
        sample_rows: list[int] = []  # flat index of each sampled token's last query token
        sample_reqs: list[_ReqState] = []
        req_ids = list(so.num_scheduled_tokens)
        sampled_slot: list[int] = []  # per request: index into sample_reqs or -1
        for rid in req_ids:
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
            block_tables.append(st.block_ids)
            seq_lens.append(end)
            query_lens.append(n)
            st.num_computed = end
            if end == len(st.token_ids):
                sampled_slot.append(len(sample_reqs))
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(st)
            else:
                sampled_slot.append(-1)
        dev = self.device
        meta = AttentionMetadata.build(block_tables, seq_lens, query_lens, self.block_size, dev)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        hidden = self.model(ids_t, pos_t, self.kv_cache, meta)
        tokens: list[int] = []
        logprobs = None
        if sample_reqs:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            tokens, logprobs = self.sampler.sample(
                logits,
                [st.params for st in sample_reqs],
                [len(st.token_ids) for st in sample_reqs],
                [len(st.token_ids) - st.num_prompt for st in sample_reqs],
                [self.eos_token_id] * len(sample_reqs),
            )
            for st, tok in zip(sample_reqs, tokens):
                st.token_ids.append(tok)
        out.req_ids = req_ids
        out.sampled_token_ids = [[tokens[k]] if k >= 0 else [] for k in sampled_slot]
        if logprobs is not None:
            out.logprobs = [
                [logprobs[k]] if k >= 0 and logprobs[k] is not None else [] for k in sampled_slot
            ]
