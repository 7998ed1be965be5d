"""Drafts as lookahead tokens: the scheduler's half of speculative decoding.

A decoding request (its last token not computed yet) may get drafts with its step:

    tokens       p0 .. p9 t10 | d1 d2 d3          t10: last token, d*: drafts
    step         computes t10 d1 d2 d3 (4 KV slots), samples 4 positions
    verified     t11 = d1 ok, d2 ok, d3 rejected -> tokens t11 t12 t13 (t13: the target's)
    after        computed = 13 (t10 d1 d2 = t10 t11 t12); d3's KV slot is dropped, and
                 blocks past the computed tokens go back to the pool

The drafts never enter ``all_token_ids`` before they are accepted, so prefix caching
(which hashes known tokens only) and preemption (which recomputes known tokens) never see
a rejected one. The step's tokens go through ``outputs.check_stop`` one by one, so EOS, stop ids,
``max_tokens`` and ``max_model_len`` cut an accepted run where the plain engine stops.

Adaptive drafting (``scheduler/spec/adaptive.py``): each request keeps its own cap on
drafts (``Request.spec_k``), which starts at 1, grows only while drafts are kept, and
switches the request off when its acceptance is below what a draft costs at the step's
batch size; an off request probes with one draft on the rare probe steps. The cap
changes only how many tokens are drafted, never which are accepted, so outputs are the
same either way.
"""

from __future__ import annotations

from tandem.scheduler.kv_cache_manager import KVCacheManager
from tandem.scheduler.request import Request
from tandem.scheduler.spec.adaptive import DraftPolicy
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.scheduler.spec.proposer import can_speculate, make_proposer
from tandem.wire.engine_protocol import SchedulerStats


class SpecDecodeStats:
    """Cumulative counters, vLLM's ``spec_decode_*`` metrics."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0  # steps that carried drafts, summed over requests
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens  # draft j accepted

    def fill(self, stats: SchedulerStats) -> None:
        stats.spec_decode_num_drafts = self.num_drafts
        stats.spec_decode_num_draft_tokens = self.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = self.num_accepted_tokens
        stats.spec_decode_num_accepted_tokens_per_pos = list(self.accepted_per_pos)


class Lookahead:
    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = make_proposer(config)
        self.kv = kv
        self.stats = SpecDecodeStats(self.k)
        self.policy = DraftPolicy(self.k)

    def active(self, num_running: int) -> bool:
        """Do this step's requests draft? Not from ``disable_by_batch_size`` running on."""
        off = self.config.disable_by_batch_size
        return off is None or num_running < off

    def begin_step(self, num_running: int) -> bool:
        """A step with ``num_running`` running requests is being scheduled: do its
        requests draft (``active``)? Tells the adaptive policy the step's batch."""
        if not self.active(num_running):
            return False
        self.policy.begin_step(num_running)
        return True

    def draft(self, req: Request, budget_left: int, max_model_len: int) -> list[int]:
        """Drafts for a decoding request about to be scheduled with one token, so that
        the step never samples past ``max_tokens`` or ``max_model_len``, nor goes over
        the budget (``budget_left``: tokens left after its one). Sets
        ``req.spec_token_ids``."""
        return self.propose(req, min(self.wanted(req, max_model_len), budget_left))

    def wanted(self, req: Request, max_model_len: int) -> int:
        """How many drafts a decoding request would carry this step, budget aside (0:
        none): its cap (the one held while its draft caught up, else the policy's; asked
        once per step), cut so that the step never samples past ``max_tokens`` or
        ``max_model_len``. Clears ``req.spec_token_ids`` and the held cap."""
        cap = req.spec_hold or self.policy.cap(req)
        req.spec_hold = 0
        req.spec_token_ids = []
        if cap == 0 or not can_speculate(req):
            return 0
        limit = min(
            cap,
            req.sampling_params.max_tokens - req.num_output_tokens - 1,
            max_model_len - req.num_tokens - 1,
        )
        return max(limit, 0)

    def propose(self, req: Request, num: int) -> list[int]:
        """``num`` drafts at most (the proposer may find fewer); sets ``req.spec_token_ids``."""
        for_request = getattr(self.proposer, "propose_for", None)
        if for_request is not None:  # keeps per-request state: asked every step
            req.spec_token_ids = for_request(req, num)
        else:
            req.spec_token_ids = self.proposer.propose(req.all_token_ids, num) if num > 0 else []
        return req.spec_token_ids

    def lag(self, req: Request) -> int:
        """Positions before a decoding request's last token whose draft-model KV the
        runner does not hold (0 for prompt lookup, which has no KV)."""
        if not self.config.uses_draft_model:
            return 0
        return req.num_computed_tokens - req.draft_computed

    def accept(self, req: Request, num_sampled: int) -> None:
        """The step of ``req``'s drafts returned ``num_sampled`` tokens (accepted drafts
        + the target's one): take back the rejected drafts' KV slots, count."""
        drafts = req.spec_token_ids
        req.spec_token_ids = []
        num_accepted = num_sampled - 1
        num_rejected = len(drafts) - num_accepted
        assert 0 <= num_rejected <= len(drafts), (req.request_id, num_sampled, drafts)
        req.num_computed_tokens -= num_rejected
        self.kv.free_tail(req, req.num_computed_tokens)
        if self.config.uses_draft_model:  # the draft's KV of rejected drafts is void
            req.draft_computed = min(req.draft_computed, req.num_computed_tokens)
        self.policy.update(req, len(drafts), num_accepted)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_pos[j] += 1
