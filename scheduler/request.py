"""A request as one engine's scheduler tracks it.

The scheduler schedules tokens, not phases: ``num_computed_tokens`` catches
up with ``num_tokens``. Prefill, chunking, prefix hits, resumption after
preemption and remote KV are all cases of that one rule.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from tandem.wire.engine_protocol import EngineRequest, FinishReason, Logprobs, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    WAITING_FOR_FSM = 4  # its grammar compiles off the step (workers/structured/manager.py)
    # everything from here on is finished
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_IGNORED = 13
    FINISHED_ERROR = 14

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "num_prompt_tokens",
        "all_token_ids",
        "sampling_params",
        "priority",
        "arrival_time",
        "arrival_mono",
        "cache_salt",
        "kv_transfer_params",
        "eos_token_id",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "stop_reason",
        "error",
        "block_hashes",
        "pending_logprobs",
        "first_scheduled_time",
        "n",
        "parent_id",
        "sample_index",
        "num_output_placeholders",
        "spec_token_ids",
        "spec_k",
        "spec_wait",
        "spec_rate",
        "spec_misses",
        "spec_hold",
        "draft_computed",
        "ngram_index",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        n: int = 1,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # when this process received it, on its own monotonic clock (durations
        # that travel with the request, like a KV lease, count from here)
        self.arrival_mono = time.monotonic()
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        self.eos_token_id = eos_token_id
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 = not yet
        self.num_preemptions = 0
        self.stop_reason: int | None = None
        self.error: str | None = None
        self.block_hashes: list[bytes] = []  # hashes of full blocks, filled lazily
        self.pending_logprobs: list[Logprobs] | None = None
        self.first_scheduled_time: float | None = None
        # parallel sampling (scheduler/fork.py): n > 1 on the parent and its
        # children; a child knows its parent's id and its choice index
        self.n = n
        self.parent_id: str | None = None
        self.sample_index = 0
        # tokens sampled by steps still in flight (overlapped loop,
        # scheduler/async_scheduler.py): scheduled as if already known
        self.num_output_placeholders = 0
        # drafts scheduled with this step, not yet verified (scheduler/spec/lookahead.py)
        self.spec_token_ids: list[int] = []
        # prompt lookup's index of this request's n-grams (scheduler/spec/proposer.py),
        # built on its first lookup and extended as tokens are appended
        self.ngram_index: Any = None
        # adaptive drafting (scheduler/spec/adaptive.py): the request's own draft cap
        # (-1: not set yet); while it is 0, the probe steps it still skips and its missed
        # probes in a row; its measured acceptance per draft token
        self.spec_k = -1
        self.spec_wait = 0
        self.spec_misses = 0
        self.spec_rate = 1.0
        # a draft model's catch-up (scheduler/drafting.py): the cap kept from the step
        # that found its draft behind (0: none), and how many positions of the draft's KV
        # the model runner holds (ReqState.draft_computed, mirrored: 0 for every new copy)
        self.spec_hold = 0
        self.draft_computed = 0

    @classmethod
    def from_engine_request(cls, req: EngineRequest, eos_token_id: int | None) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id=eos_token_id,
            priority=req.priority,
            arrival_time=req.arrival_time or None,
            cache_salt=req.cache_salt,
            kv_transfer_params=req.kv_transfer_params,
            n=req.n,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __lt__(self, other: Request) -> bool:
        # priority queue order: lower priority value first, then arrival, then id
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
