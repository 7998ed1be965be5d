"""A backend without engines: deterministic tokens, produced at once.

For gateway tests and the gateway-overhead benchmark. Output token ``i`` of
every request is ``output_token_ids[i % len(output_token_ids)]`` (by default
the tokens of "The quick brown fox jumps over the lazy dog. "), sent
``num_tokens_per_output`` per ``EngineOutput`` and ``outputs_per_turn``
outputs per event-loop turn (more than one: a gateway that runs that many
engine steps behind, its outputs ready together, ``Backend.num_ready``). Honours ``max_tokens``,
``max_model_len``, ``min_tokens``, stop token ids, EOS (unless
``ignore_eos``), logprobs, prompt logprobs (on the first output) and aborts,
like an engine would. With ``n > 1`` every output is sent once per choice
(same tokens, ``index`` 0..n-1).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from typing import Any

from tandem.cluster.gateway.backend import (
    Backend,
    BackendMetrics,
    BackendUnavailable,
    EngineMetrics,
)
from tandem.scheduler.engine_stats import EngineStats, HistogramSnapshot, KVTransferStats
from tandem.wire.engine_protocol import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    Logprobs,
    RequestTimings,
    SchedulerStats,
)

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog. "


class NullBackend(Backend):
    def __init__(
        self,
        tokenizer: Any,
        *,
        model_name: str = "tiny",
        max_model_len: int = 4096,
        num_tokens_per_output: int = 1,
        output_token_ids: list[int] | None = None,
        output_interval_s: float = 0.0,
        max_num_running: int | None = None,
        outputs_per_turn: int = 1,
    ) -> None:
        """``output_interval_s`` paces outputs (0: yield to the loop only);
        ``max_num_running`` makes ``generate`` raise ``BackendUnavailable``
        beyond that many concurrent requests."""
        if num_tokens_per_output < 1:
            raise ValueError(f"num_tokens_per_output must be >= 1, got {num_tokens_per_output}")
        if outputs_per_turn < 1:
            raise ValueError(f"outputs_per_turn must be >= 1, got {outputs_per_turn}")
        self.outputs_per_turn = outputs_per_turn
        self._num_ready: dict[str, int] = {}  # per request: outputs of this turn not yet taken
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.num_tokens_per_output = num_tokens_per_output
        self.output_token_ids = output_token_ids or list(
            tokenizer.encode(DEFAULT_TEXT, add_special_tokens=False)
        )
        self.output_interval_s = output_interval_s
        self.max_num_running = max_num_running
        # Fault injection: end every request with an ERROR output after this many tokens.
        self.fail_after_num_tokens: int | None = None
        self.aborted_request_ids: collections.deque[str] = collections.deque(maxlen=4096)
        self._ready, self._not_ready_reason = True, ""
        self._running: set[str] = set()
        self._aborting: set[str] = set()
        self._num_requests = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    @classmethod
    def tiny(cls, **kwargs: Any) -> NullBackend:
        """A NullBackend with the built-in tiny model's tokenizer (in a process that
        barred torch, as ``tandem serve``'s does, a checkpoint not yet built is built in a child)."""
        from tandem.workers.checkpoints.model_dir import resolve_model_dir
        from tandem.workers.text.tokenizer import load_tokenizer

        return cls(load_tokenizer(resolve_model_dir("tiny")), **kwargs)

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self._ready, self._not_ready_reason = ready, reason

    def is_ready(self) -> tuple[bool, str]:
        return self._ready, ("" if self._ready else self._not_ready_reason or "not ready")

    @property
    def num_running(self) -> int:
        return len(self._running)

    def token_ids_for(self, num_tokens: int) -> list[int]:
        """The first ``num_tokens`` output tokens of any request."""
        cycle = self.output_token_ids
        return [cycle[i % len(cycle)] for i in range(num_tokens)]

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self._ready:
            raise BackendUnavailable(f"No ready engine: {self._not_ready_reason or 'not ready'}")
        if self.max_num_running is not None and len(self._running) >= self.max_num_running:
            raise BackendUnavailable(f"Overloaded: {len(self._running)} requests running")
        params = request.sampling_params
        request_id = request.request_id
        stop_ids = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_token_id)
        budget = min(params.max_tokens, self.max_model_len - len(request.prompt_token_ids))
        cycle = self.output_token_ids
        self._running.add(request_id)
        self._num_requests += 1
        self._num_prompt_tokens += len(request.prompt_token_ids)
        num_done = 0
        received_s = time.perf_counter()
        first_token_s = -1.0
        num_ready, per_turn = self._num_ready, self.outputs_per_turn
        together = per_turn > 1 or request.n > 1  # else none is ever ready behind another
        num_left = per_turn  # outputs of this loop turn, this one included
        # One token per output, one choice, no logprobs, one output per turn: then every
        # output but the last is a bare token id, made without the general path below
        # (this backend runs in the gateway's process, so its CPU counts as the gateway's).
        simple = (
            not together
            and self.num_tokens_per_output == 1
            and params.logprobs is None
            and params.prompt_logprobs is None
        )
        ncycle, min_tokens, interval_s = len(cycle), params.min_tokens, self.output_interval_s
        aborting, sleep = self._aborting, asyncio.sleep
        try:
            while True:
                if simple and self.fail_after_num_tokens is None and request_id not in aborting:
                    token_id = cycle[num_done % ncycle]
                    if num_done + 1 < budget and (
                        token_id not in stop_ids or num_done + 1 < min_tokens
                    ):
                        num_done += 1
                        self._num_generation_tokens += 1
                        if first_token_s < 0:
                            first_token_s = time.perf_counter() - received_s
                        yield EngineOutput(request_id, [token_id])
                        await sleep(interval_s)
                        continue
                if request_id in self._aborting:
                    for index in range(request.n):
                        yield EngineOutput(
                            request_id, finish_reason=FinishReason.ABORT, index=index
                        )
                    return
                if (
                    self.fail_after_num_tokens is not None
                    and num_done >= self.fail_after_num_tokens
                ):
                    yield EngineOutput(
                        request_id, finish_reason=FinishReason.ERROR, error="injected"
                    )
                    return
                token_ids, finish, stop_reason = [], None, None
                while len(token_ids) < self.num_tokens_per_output and finish is None:
                    token_id = cycle[num_done % len(cycle)]
                    token_ids.append(token_id)
                    num_done += 1
                    if token_id in stop_ids and num_done >= params.min_tokens:
                        finish = FinishReason.STOP
                        stop_reason = token_id if token_id != self.eos_token_id else None
                    elif num_done >= budget:
                        finish = FinishReason.LENGTH
                self._num_generation_tokens += len(token_ids) * request.n
                prompt_logprobs = None
                if params.prompt_logprobs is not None and num_done == len(token_ids):
                    prompt_ids = request.prompt_token_ids[1:]
                    prompt_logprobs = self._logprobs(prompt_ids, params.prompt_logprobs)
                now_s = time.perf_counter()
                if first_token_s < 0:
                    first_token_s = now_s - received_s
                timings = None
                if finish is not None:  # as an engine reports them (wire.engine_protocol)
                    timings = RequestTimings(
                        "null-0",
                        0,
                        "colocated",
                        finished_s=now_s - received_s,
                        scheduled_s=0.0,
                        first_token_s=first_token_s,
                    )
                logprobs = (
                    None if params.logprobs is None else self._logprobs(token_ids, params.logprobs)
                )
                num_left -= 1
                for index in range(request.n):
                    if together:  # this turn's outputs still to come after this one
                        num_ready[request_id] = num_left * request.n + request.n - 1 - index
                    yield EngineOutput(
                        request_id,
                        new_token_ids=token_ids,
                        new_logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        finish_reason=finish,
                        stop_reason=stop_reason,
                        index=index,
                        timings=timings if index == 0 else None,
                    )
                if finish is not None:
                    return
                if num_left == 0:
                    num_left = per_turn
                    # Pace like an engine step; at 0, still one event-loop turn per output.
                    await asyncio.sleep(self.output_interval_s)
        finally:
            self._running.discard(request_id)
            self._aborting.discard(request_id)
            self._num_ready.pop(request_id, None)

    def num_ready(self, request_id: str) -> int:
        return self._num_ready.get(request_id, 0)

    def _logprobs(self, token_ids: list[int], num_top: int | None) -> list[Logprobs] | None:
        """Sampled token at -0.5; top-N alternatives: itself, then ids+1, +2... lower."""
        if num_top is None:
            return None
        entries = []
        for token_id in token_ids:
            top_ids = [token_id, *((token_id + k) % len(self.tokenizer) for k in range(1, num_top))]
            top_lps = [-0.5 - k for k in range(len(top_ids))][:num_top]
            entries.append(Logprobs(token_id, -0.5, top_ids[:num_top], top_lps, rank=1))
        return entries

    async def abort(self, request_id: str) -> None:
        self.aborted_request_ids.append(request_id)
        if request_id in self._running:
            self._aborting.add(request_id)

    def metrics_snapshot(self) -> BackendMetrics:
        stats = SchedulerStats(
            num_running_reqs=len(self._running),
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
        )
        kv = KVTransferStats(transfer_seconds=HistogramSnapshot([0.01, 0.1], [0, 0]))
        engine = EngineMetrics(
            EngineStats("null-0", "colocated", 1, scheduler=stats, kv_transfer=kv), epoch=1
        )
        return BackendMetrics([engine], {"local": self._num_requests})
