"""Adaptive drafting: how many drafts each request may carry this step.

A draft token is a row of the step's forward (MLPs, attention, the LM head) whether it is
kept or not. While a step is memory-bound (small batch: every step reads all the weights
anyway) a draft costs almost nothing and one kept now and then pays; once the step is
compute-bound (large batch on a CPU) a draft costs about what a request's row costs and
pays only if it is kept often. With ``B`` requests running, a step without drafts costs
about ``c0 + c * B`` for ``B`` tokens; ``D`` drafts of which ``A`` are kept add ``c * D``
and ``A`` tokens. That is a gain when

    A / D  >  B / (B + B0)         B0 = c0 / c  (BREAK_EVEN_BATCH)

so the acceptance a draft must reach (``need``) grows with the batch: 0.11 alone, 0.5 at
8 requests, 0.8 at 32 (B0 = 8). The policy, per request:

    start        until its first drafts are verified, a request goes by the batch's
                 measured acceptance: one draft while that reaches ``need``, else none
                 but on probe steps
    all kept     cap doubles (1, 2, 4 .. K): the cap grows only on acceptance
    some kept    cap = the kept run + 1
    none kept    cap halves (down to 1)
    off          when the request's own acceptance (``spec_rate``, halfway to each step's
                 kept fraction) falls below ``need``: after one miss at 32 requests, two
                 at 8, four alone
    while off    drafts nothing; probes with one draft on probe steps only (every
                 PROBE_STEPS steps, times ceil(B / B0)), so the probes of
                 many requests share a few steps instead of spreading over all of them;
                 each missed probe in a row doubles the probe steps it skips (up to
                 2**MAX_BACKOFF - 1); a kept probe turns it back on at cap 1

Only how many tokens are drafted changes, never which are kept: greedy outputs are the
same with any cap, and a seeded sampled request follows rules of its own steps only
(``is_seeded``), so its tokens do not depend on its batch mates. ``disable_by_batch_size`` (``SpeculativeConfig``) stays the explicit switch that
turns drafting off from a batch size on, whatever the acceptance.
"""

from __future__ import annotations

from tandem.scheduler.request import Request

# c0 / c: the batch at which a step's per-row compute equals its fixed cost (smollm2
# fp32 on the CPU box: steps of 48, 100 and 202 ms at 1, 8 and 32 requests put it at
# 6-15; docs/benchmarks.md, issue #26)
BREAK_EVEN_BATCH = 8
# steps between probe steps (times ceil(B / BREAK_EVEN_BATCH))
PROBE_STEPS = 16
# a request that keeps missing skips at most 2**MAX_BACKOFF - 1 probe steps
MAX_BACKOFF = 4
# weight of the newest step in a request's acceptance, and in the batch's
REQUEST_WEIGHT = 0.5
BATCH_WEIGHT = 0.125


def break_even(num_running: int) -> float:
    """The acceptance per draft token at which drafting pays with ``num_running``
    requests in the step."""
    return num_running / (num_running + BREAK_EVEN_BATCH)


def is_seeded(req: Request) -> bool:
    """A seeded sampled request: its drafts decide which random draws verify them, so
    its policy counts its own steps only (the acceptance it needs is one request's, its
    probes come every PROBE_STEPS of its own steps): its tokens then do not depend on its
    batch mates, as without the policy."""
    sp = req.sampling_params
    return sp.seed is not None and sp.temperature > 0


class DraftPolicy:
    """Per-request draft caps (``Request.spec_k``), deterministic in the steps' outcomes."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps = 0
        self.num_running = 0
        self.need = 0.0
        self.probe_step = False
        # the batch's measured acceptance per draft token (optimistic until measured)
        self.rate = 1.0

    def begin_step(self, num_running: int) -> None:
        """A step with ``num_running`` running requests starts drafting."""
        self.steps += 1
        self.num_running = num_running
        self.need = break_even(num_running)
        self.probe_step = self.steps % self.probe_period(num_running) == 0

    @staticmethod
    def probe_period(num_running: int) -> int:
        return PROBE_STEPS * max(1, -(-num_running // BREAK_EVEN_BATCH))

    def cap(self, req: Request) -> int:
        """How many drafts ``req`` may carry this step (before the step's other limits)."""
        own = is_seeded(req)
        if req.spec_k < 0:  # nothing verified yet: the batch's acceptance speaks for it
            return 1 if own or self.rate >= self.need or self.probe_step else 0
        if req.spec_k:
            return req.spec_k
        if own:  # its own steps count to its probes
            req.spec_wait = max(req.spec_wait - 1, 0)
            return 0 if req.spec_wait else 1
        if not self.probe_step:
            return 0
        if req.spec_wait > 0:
            req.spec_wait -= 1
            return 0
        return 1  # the probe

    def update(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """``req``'s step carried ``num_drafts`` drafts, ``num_accepted`` were kept."""
        own = is_seeded(req)
        need = break_even(1) if own else self.need
        kept = num_accepted / num_drafts
        if req.spec_k < 0:  # its first verified drafts: from the batch's acceptance on
            req.spec_k, req.spec_rate = 1, 1.0 if own else self.rate
        req.spec_rate += REQUEST_WEIGHT * (kept - req.spec_rate)
        self.rate += BATCH_WEIGHT * (kept - self.rate)
        if req.spec_k == 0:  # a probe
            if num_accepted:
                req.spec_k, req.spec_misses = 1, 0
                req.spec_rate = max(req.spec_rate, need)
            else:
                req.spec_misses = min(req.spec_misses + 1, MAX_BACKOFF)
                req.spec_wait = 2**req.spec_misses - 1
                if own:
                    req.spec_wait = PROBE_STEPS * 2**req.spec_misses
            return
        cap = req.spec_k
        if num_accepted == num_drafts:
            cap = min(self.k, max(cap, 2 * num_accepted))
        elif num_accepted:
            cap = num_accepted + 1
        else:
            cap = max(cap // 2, 1)
        if req.spec_rate < need:
            cap = 0
        req.spec_k = cap
        if cap == 0:  # probes on the next probe step (a seeded request: PROBE_STEPS on)
            req.spec_wait = PROBE_STEPS if own else 0

    def check_integrity(self, running: list[Request]) -> None:
        """Every running request's policy state within its bounds."""
        assert 0.0 <= self.rate <= 1.0, self.rate
        for r in running:
            assert -1 <= r.spec_k <= self.k, (r.request_id, r.spec_k)
            assert 0.0 <= r.spec_rate <= 1.0, (r.request_id, r.spec_rate)
            assert 0 <= r.spec_misses <= MAX_BACKOFF, (r.request_id, r.spec_misses)
            assert 0 <= r.spec_wait <= PROBE_STEPS * 2**MAX_BACKOFF, (r.request_id, r.spec_wait)
