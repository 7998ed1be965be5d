"""Scheduling policies: who goes first, who is preempted, what may be admitted.

    policy          waiting order            running order each step        victim
    fcfs            arrival                  admission order                newest running
    priority        (priority, arrival)      admission order                largest (priority, arrival)
    prefill-first   arrival                  prefills, then decodes         newest running

``priority`` also preempts on arrival: when the best waiting request cannot
be admitted (no sequence slot or not enough free blocks) and a running
request has a strictly larger ``priority`` value, the worst such request is
preempted before the step is built (vLLM's semantics: lower value first).

Admission control (every policy):

- ``kv_admission_margin``: a new request is admitted only if, after its
  blocks are taken, at least this fraction of the pool stays free, so the
  requests already running can grow without being preempted right away.
  A lone request is always admitted (the engine could never start it
  otherwise).
- Partial prefills: at most ``max_num_partial_prefills`` requests with more
  than one token to compute are scheduled per step, of which at most
  ``max_long_partial_prefills`` are long (more than
  ``long_prefill_token_threshold`` tokens left). A long prompt that hits its
  limit is passed over for this step, so shorter prompts behind it overtake
  it; it keeps its place at the head of the queue and runs as soon as a
  long slot frees (the long prefills in progress always make progress, so
  the wait is bounded).
"""

from __future__ import annotations

from typing import Any

from tandem.scheduler.request import Request

POLICIES = ("fcfs", "priority", "prefill-first")


def check_policy(name: str, field: str = "policy") -> str:
    if name not in POLICIES:
        raise ValueError(f"{field} must be one of {list(POLICIES)}, got {name!r}")
    return name


def check_fields(config: Any) -> None:
    """Validate the scheduling fields shared by ``SchedulerConfig`` and
    ``workers.config.EngineConfig``; ``ValueError`` naming the field."""
    check_policy(config.policy)
    if not 0.0 <= config.kv_admission_margin < 1.0:
        raise ValueError(f"kv_admission_margin must be in [0, 1), got {config.kv_admission_margin}")
    for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(config, name)}")
    if config.max_long_partial_prefills and not config.long_prefill_token_threshold:
        raise ValueError(
            "max_long_partial_prefills needs long_prefill_token_threshold > 0 (what counts as long)"
        )


def queue_kind(policy: str) -> str:
    """The waiting queue a policy uses (scheduler/queues.py)."""
    return "priority" if policy == "priority" else "fcfs"


def order_running(policy: str, running: list[Request]) -> None:
    """Reorder ``running`` in place for this step (prefill-first only):
    requests with more than one token left go first, each group keeping its order."""
    if policy != "prefill-first" or len(running) < 2:
        return
    prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
    if prefills and len(prefills) < len(running):
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
        running[:] = prefills + decodes


def pick_victim(policy: str, running: list[Request]) -> Request:
    """The running request to preempt when a block is missing."""
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    if policy == "prefill-first":  # running is reordered: the newest by arrival
        return max(running, key=lambda r: (r.arrival_time, r.request_id))
    return running[-1]


def arrival_victim(running: list[Request], arrival: Request) -> Request | None:
    """Priority policy: the running request ``arrival`` may preempt (strictly
    larger priority value; the worst first), or None."""
    worst = None
    for r in running:
        if r.priority > arrival.priority and (
            worst is None or (r.priority, r.arrival_time) > (worst.priority, worst.arrival_time)
        ):
            worst = r
    return worst


class PrefillLimits:
    """Counts one step's partial prefills against the configured limits.

    ``max_num_partial`` / ``max_long_partial``: 0 = no limit. A request is in
    prefill when it has more than one token left to compute; it is long when
    more than ``long_threshold`` tokens are left (only with a threshold set).
    """

    __slots__ = ("max_num_partial", "max_long_partial", "long_threshold", "num", "num_long")

    def __init__(self, max_num_partial: int, max_long_partial: int, long_threshold: int) -> None:
        self.max_num_partial = max_num_partial
        self.max_long_partial = max_long_partial
        self.long_threshold = long_threshold
        self.num = 0
        self.num_long = 0

    @property
    def active(self) -> bool:
        return bool(self.max_num_partial or self.max_long_partial)

    def is_long(self, num_left: int) -> bool:
        return bool(self.long_threshold) and num_left > self.long_threshold

    def allows(self, num_left: int) -> bool:
        """May a request with ``num_left`` tokens to compute run this step?"""
        if num_left <= 1:
            return True
        if self.max_num_partial and self.num >= self.max_num_partial:
            return False
        if self.max_long_partial and self.is_long(num_left):
            return self.num_long < self.max_long_partial
        return True

    def take(self, num_left: int) -> None:
        if num_left > 1:
            self.num += 1
            if self.is_long(num_left):
                self.num_long += 1

    def release(self, num_left: int) -> None:
        """Undo ``take`` (the request was preempted after being counted)."""
        if num_left > 1:
            self.num -= 1
            if self.is_long(num_left):
                self.num_long -= 1


def margin_blocks(num_blocks: int, margin: float) -> int:
    """Blocks admission keeps free (``kv_admission_margin`` of the pool)."""
    return int(num_blocks * margin)
