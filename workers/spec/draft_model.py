"""The draft-model proposer: a second model drafts the tokens the target verifies.

    --speculative-config '{"method": "draft_model", "model": "smollm2",
                           "num_speculative_tokens": 4}'

The scheduler schedules a request's k drafts as ``MODEL_DRAFT`` slots
(``scheduler/spec/proposer.py``) and allocates their KV slots; at the start of the step,
before the target's forward, ``DraftModel.fill`` runs up to K proposal forwards batched
over the step's drafting requests and writes the drafted tokens into the slots:

    tokens       t0 .. t(L-1)              (t(L-1): the last token, not computed yet)
    draft KV     valid for positions < v   (ReqState.draft_computed)
    forward 0    t(v) .. t(L-1) at positions v .. L-1 (catch-up + the last token) -> d1
    forward j    d(j) at position L-1+j                                            -> d(j+1)
    after        draft KV valid below L-1+k if every draft is accepted; verification
                 keeps a drafts, so below L + min(a, k-1) (``spec_step.apply_result``)

The draft's KV cache has the target's block size and number of blocks and is indexed by
the request's own block table (same block ids, tensors of the draft's shape), so there is
no second allocator: every position the draft writes lies in a block the request holds in
this step (at most position L+k-2, and the step holds slots up to L-1+k).

Which draft KV is valid is tracked per request by the runner, not per block: a request
starts with ``draft_computed = 0`` whenever the runner gets a new copy of it (admission,
a prefix hit, KV that came from a prefill engine or a KV tier, resumption after
preemption, a forked child), and the draft recomputes its own missing positions. The
handoff from a prefill engine therefore carries no draft KV. The scheduler budgets that
catch-up like a prefill (``scheduler/drafting.py``): a request with drafts recomputes its
few missing positions in forward 0; a request further behind than the step's budget
allows gets a chunk of ``SchedulerOutput.draft_catch_up`` per step instead (a query that
rides in forward 0, or a forward of its own in a step without drafts, and needs no
logits), and drafts once caught up. The scheduler mirrors ``draft_computed``
(``Request.draft_computed``); ``check`` compares the two. Draft KV that is stale or
missing can only lower acceptance: verification decides every emitted token from the
target's logits, so outputs stay exact.

Greedy requests draft the draft's argmax. Sampled requests draw each draft from the
draft's own distribution ``q`` (the request's temperature, min-p, top-k, top-p applied to
the draft's logits), with a uniform of a third stream of the request's key (after the
plain sampler's and the acceptance test's); ``q`` goes to ``spec_verify`` with the draft,
which accepts with probability ``min(1, p/q)`` and on rejection draws from
``max(p - q, 0)``, so every token keeps the target's distribution.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.kernels.metadata import host_to_device, list_to_device
from tandem.kernels.prefill_attention import use_sdpa_prefills
from tandem.scheduler.spec.proposer import MODEL_DRAFT
from tandem.wire.config_fields import default_of
from tandem.workers.config.sections import GraphsConfig
from tandem.workers.runner.dense_decode import DenseDecodeKV
from tandem.workers.runner.step_forward import step_metadata
from tandem.workers.sampling.sampler import argmax_rows, mix_seed, sampling_probs, uniform_for
from tandem.workers.sampling.spec_verify import inverse_cdf, is_greedy

# keys the draft's own draws, apart from the sampler's and the acceptance test's
_DRAFT_STREAM = 0x8CB92BA72F3D8DD7
# CPU dense decode rows of the draft's own (workers/runner/dense_decode.py): queries up to
# this many tokens take them (a proposal step, a short catch-up); longer catch-ups (a
# prompt) take the paged kernels and drop the row
_DENSE_MAX_QUERY = 17


class DraftModel:
    """The runner's drafter (``ModelRunner.drafter``) for ``method: draft_model``."""

    def __init__(
        self,
        model: Any,
        kv_cache: torch.Tensor,
        block_size: int,
        prefill_attention: str = default_of(GraphsConfig, "prefill_attention"),
        dense_decode_bytes: int = 0,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.sdpa_prefills = use_sdpa_prefills(prefill_attention, self.device, kv_cache.dtype)
        # CPU fp32: dense decode rows over the draft's cache, as the runner's over the target's
        self.dense = None
        if dense_decode_bytes > 0:
            num_heads = model.config.num_attention_heads
            self.dense = DenseDecodeKV(kv_cache, num_heads, dense_decode_bytes)
        # CUDA: full graphs of the draft's forwards (workers/graphs/build.build_draft_graphs);
        # a forward with a query longer than K + 1 (a long catch-up) runs eager
        self.graphs: Any = None
        # figures: forwards run, tokens the draft computed again (catch-up), drafts made
        self.num_forwards = 0
        self.num_catch_up_tokens = 0
        self.num_drafted = 0

    def release(self, req_ids: list[str]) -> None:
        """Drop the dense rows of requests the runner forgot or copied anew (step stream)."""
        if self.dense is not None:
            for rid in req_ids:
                self.dense.release(rid)

    def release_if_idle(self, now_s: float) -> None:
        if self.dense is not None:
            self.dense.release_if_idle(now_s)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A fork's copied block, in the draft's cache too (its children start with
        ``draft_computed = 0`` all the same: this only keeps the block's bytes alike)."""
        self.kv_cache[dst] = self.kv_cache[src]

    @torch.inference_mode()
    def fill(self, spec: Any, segments: list[Any], catch_up: list[tuple] = ()) -> None:
        """Replace the ``MODEL_DRAFT`` slots of the step's drafting requests with drafted
        tokens: in their segments (the verification forward's query) and in their
        ``SpecRequest`` (what verification judges, with ``q`` for sampled requests).
        ``spec``: the step's ``workers.runner.spec_step.SpecPlan`` (None: no drafts).
        ``catch_up``: ``(state, req_id, token ids, first position, block table)`` of the
        requests whose draft only catches up this step (``StepPlan.draft_catch_up``); their
        queries ride in the first forward, which needs no logits of theirs."""
        work = []  # (segment index, state, SpecRequest)
        if spec is not None:
            for i, st, req in zip(spec.segments, spec.states, spec.requests, strict=True):
                if req.drafts and req.drafts[0] == MODEL_DRAFT:
                    work.append((i, st, req))
        extra = [(rid, ids, start, table) for _, rid, ids, start, table in catch_up]
        if extra:
            self.num_catch_up_tokens += sum(len(ids) for _, ids, _, _ in extra)
        if not work:
            if extra:
                self._forward(extra, 0)
                self._caught_up(catch_up)
            return
        num_steps = max(len(req.drafts) for _, _, req in work)
        drafts: list[list[int]] = [[] for _ in work]
        probs: list[list[torch.Tensor]] = [[] for _ in work]
        for j in range(num_steps):
            rows = [m for m, (_, _, req) in enumerate(work) if len(req.drafts) > j]
            queries = []  # (req_id, token ids, first position, block table)
            for m in rows:
                i, st, req = work[m]
                num_tokens = len(st.token_ids)  # L: the last token is t(L-1)
                if j == 0:
                    start = min(st.draft_computed, num_tokens - 1)
                    ids = st.token_ids[start:]
                    self.num_catch_up_tokens += num_tokens - 1 - start
                else:
                    start = num_tokens - 1 + j
                    ids = [drafts[m][-1]]
                queries.append((segments[i].req_id, ids, start, segments[i].block_ids))
            logits = self._forward(queries + extra if j == 0 else queries, len(queries))
            self._choose(logits, [work[m][2] for m in rows], j, rows, drafts, probs)
        self._caught_up(catch_up)
        for m, (i, st, req) in enumerate(work):
            k = len(req.drafts)
            req.drafts = drafts[m]
            if probs[m]:
                req.draft_probs = torch.stack(probs[m])
            segments[i].token_ids[-k:] = drafts[m]
            # valid if every draft is kept; apply_result lowers it to the kept ones
            st.draft_computed = len(st.token_ids) - 1 + k
            self.num_drafted += k

    @staticmethod
    def _caught_up(catch_up: list[tuple]) -> None:
        for st, _, ids, start, _ in catch_up:
            st.draft_computed = start + len(ids)

    def _forward(
        self, queries: list[tuple[str, list[int], int, list[int]]], num_logits: int
    ) -> torch.Tensor | None:
        """The draft's logits at the last token of each of the first ``num_logits``
        queries, in ``queries``' order (the rest only write their KV: a catch-up). A
        query: ``(req_id, token ids, position of the first, block table)``."""
        dev = self.device
        order, dense_step = self._order_for_dense(queries)
        ids, positions, tables, seq_lens, query_lens = [], [], [], [], []
        for m in order:
            _, tokens, start, table = queries[m]
            ids += tokens
            positions += range(start, start + len(tokens))
            tables.append(table)
            seq_lens.append(start + len(tokens))
            query_lens.append(len(tokens))
        hidden = None
        if self.graphs is not None and dense_step is None:
            hidden = self.graphs.run(ids, positions, tables, seq_lens, query_lens=query_lens)
        if hidden is None:
            meta = step_metadata(
                tables, seq_lens, query_lens, positions, dense_step, dev, self.block_size,
                self.sdpa_prefills,
            )  # fmt: skip
            ids_t = host_to_device(torch.tensor(ids, dtype=torch.long), dev)
            pos_t = host_to_device(torch.tensor(positions, dtype=torch.long), dev)
            hidden = self.model(ids_t, pos_t, self.kv_cache, meta)
        self.num_forwards += 1
        if not num_logits:
            return None
        last = [0] * len(queries)  # flat row of each query's last token, by query
        row = -1
        for m, n in zip(order, query_lens):
            row += n
            last[m] = row
        last = last[:num_logits]
        if last != list(range(hidden.shape[0])):
            hidden = hidden.index_select(0, list_to_device(last, dev, torch.long))
        return self.model.compute_logits(hidden).float()

    def _order_for_dense(self, queries: list[tuple]) -> tuple[list[int], Any]:
        """Query order: those on the dense rows first (by row), then the rest."""
        everything = list(range(len(queries)))
        if self.dense is None:
            return everything, None
        decodes, indices = [], []
        for m, (rid, tokens, start, table) in enumerate(queries):
            if len(tokens) <= _DENSE_MAX_QUERY:
                decodes.append((rid, start, table, len(tokens)))
                indices.append(m)
            else:
                self.dense.release(rid)  # a long catch-up: the paged kernels
        return self.dense.order(decodes, indices, len(queries))

    def _choose(
        self,
        logits: torch.Tensor,
        requests: list[Any],
        j: int,
        rows: list[int],
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Draft ``j`` of each request: the argmax (greedy requests) or a draw from ``q``."""
        greedy = [is_greedy(r.params) for r in requests]
        chosen = argmax_rows(logits).tolist() if any(greedy) else [0] * len(requests)
        random = [n for n, g in enumerate(greedy) if not g]
        if random:
            sub = logits.index_select(0, list_to_device(random, logits.device, torch.long))
            q = sampling_probs(sub, [requests[n].params for n in random])
            uniforms = []
            for n in random:
                r = requests[n]
                key = r.params.seed if r.params.seed is not None else r.stream_key
                uniforms.append(uniform_for(mix_seed(key, _DRAFT_STREAM), r.position + j))
            drawn = inverse_cdf(q, uniforms).tolist()
            for n, token, row in zip(random, drawn, q, strict=True):
                chosen[n] = token
                probs[rows[n]].append(row)
        for n, m in enumerate(rows):
            drafts[m].append(chosen[n])

    def check(self, states: dict[str, Any], running: list[Any] = ()) -> None:
        """``check_integrity``: no request's draft KV counts past its computed tokens
        (positions past them sit in blocks the request may not hold), and the scheduler's
        count of it (``Request.draft_computed``, ``running``: its running requests) is the
        runner's (it budgets the catch-up with it, ``scheduler/drafting.py``)."""
        for rid, st in states.items():
            assert 0 <= st.draft_computed <= st.num_computed, (
                f"{rid}: draft KV valid for {st.draft_computed} positions, "
                f"{st.num_computed} computed"
            )
        for req in running:
            st = states.get(req.request_id)
            if st is not None:
                assert st.draft_computed == req.draft_computed, (
                    f"{req.request_id}: the runner holds draft KV for {st.draft_computed} "
                    f"positions, the scheduler counts {req.draft_computed}"
                )
