"""The model runner's device half of a step (the step stream): the flat batch's
layout (CPU dense decode rows first), the forward (decode graphs, piecewise graphs or
eager), prompt logprobs, the LM head over the sampled and verified rows, sampling and
verification. It reads only the plan, the dense rows and the previous step's result."""

from __future__ import annotations

from typing import Any

import torch

from tandem.kernels import AttentionMetadata
from tandem.kernels.metadata import host_to_device, list_to_device
from tandem.workers.runner.async_step import StepHandle, StepResult
from tandem.workers.runner.attention import SplitAttention, StepMetadata
from tandem.workers.runner.dense_decode import DenseDecodeStep
from tandem.workers.runner.spec_step import SpecPlan, verified_rows
from tandem.workers.runner.step_batch import Segment, StepPlan, flatten
from tandem.workers.sampling.prompt_logprobs import prompt_logprobs
from tandem.workers.sampling.sample_logprobs import DeviceLogprobs
from tandem.workers.sampling.spec_verify import verify


class StepForward:
    """ModelRunner's device half (a mixin: its state is the runner's)."""

    model: Any
    kv_cache: torch.Tensor
    device: torch.device
    block_size: int
    eos_token_id: int | None
    sampler: Any
    dense: Any
    graphs: Any
    piecewise: Any
    sdpa_prefills: bool
    drafter: Any

    @torch.inference_mode()
    def _run_step(self, plan: StepPlan, prev: StepHandle | None) -> StepResult:
        """Device half of a step (step stream): layout, forward, sample. Reads only the
        plan, the dense rows and the previous step's result."""
        if self.dense is not None:
            for rid in plan.dense_release:
                self.dense.release(rid)
        if self.drafter is not None:
            self.drafter.release(plan.dense_release)
        if plan.copy_block_ids:  # a fork's partial last block, before anything writes
            src, dst = zip(*plan.copy_block_ids)
            # index tensors through pinned memory: a torch.tensor(..., device=cuda) would
            # be a hidden host wait for every kernel queued (kernels/metadata.py)
            src_t = list_to_device(src, self.device, torch.long)
            dst_t = list_to_device(dst, self.device, torch.long)
            self.kv_cache[dst_t] = self.kv_cache[src_t]
            if self.drafter is not None:
                self.drafter.copy_blocks(src_t, dst_t)
        if self.drafter is not None and (plan.spec is not None or plan.draft_catch_up):
            # a draft model's proposal forwards fill the MODEL_DRAFT slots, and its KV
            # catches up where the scheduler gave it budget (workers/spec/)
            self.drafter.fill(plan.spec, plan.segments, plan.draft_catch_up)
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
                flat.input_ids,
                flat.positions,
                flat.block_tables,
                flat.seq_lens,
                scatter,
                query_lens=flat.query_lens,
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
        return self.dense.order(decodes, decode_segments, len(segments))

    def _metadata(
        self,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        positions: list[int],
        dense_step: DenseDecodeStep | None,
    ) -> StepMetadata:
        return step_metadata(
            block_tables,
            seq_lens,
            query_lens,
            positions,
            dense_step,
            self.device,
            self.block_size,
            self.sdpa_prefills,
        )


def step_metadata(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    positions: list[int],
    dense_step: DenseDecodeStep | None,
    dev: torch.device,
    bs: int,
    sdpa_prefills: bool,
) -> StepMetadata:
    """A forward's attention metadata: the paged kernels' alone, or (CPU) the dense decode
    rows of the first ``dense_step.num_segments`` sequences and the paged kernels' for the
    rest (a draft model's forwards use it too, ``workers/spec/draft_model.py``)."""
    if dense_step is None:
        meta = AttentionMetadata.build(block_tables, seq_lens, query_lens, bs, dev)
        meta.sdpa_prefills = sdpa_prefills
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
        paged.sdpa_prefills = sdpa_prefills
        slot_mapping = torch.cat((slot_mapping, paged.slot_mapping.long()))
    return SplitAttention(slot_mapping, dense_step, paged)
