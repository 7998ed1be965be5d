"""One request's generation, output by output (``RequestRun``).

    Gateway.start(job)  ->  RequestRun      backend.generate() opened, dispatch counted
    run.outputs                             the backend's async iterator, pulled by the caller
    run.take(output) / run.step(output)     detokenize + stop strings -> text or ``Step``
    run.close()                             metrics, abort when unfinished, the request's record

``GenerationResponse`` (``responses.py``) pulls the backend's outputs itself
and hands each to its run: there is no async generator between the backend
and the SSE writer, so a streamed token crosses one generator hop (the
backend's), not two. The common token (``Job.plain``: one choice, no stop
strings, echo or prompt logprobs; an output with tokens and nothing else)
is the caller's to take on its short path (``is_plain_token``): the
inter-token observation, the count and the detokenizer's short path, its
text alone. Every other output goes through ``step``.

The caller must ``close()`` the run whatever happens (a ``finally``): that
closes the backend's iterator, aborts the request on the backend unless it
finished (disconnect, deadline, stop string, a failure) and records it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tandem.cluster.gateway.job import Job, Step, output_step
from tandem.wire.engine_protocol import EngineOutput, FinishReason
from tandem.workers.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from tandem.cluster.gateway.generation import Gateway
    from tandem.cluster.observability.metrics import LoopHistogram

_NO_FINAL = "The backend ended the request without a final output."


class RequestRun:
    """What the gateway keeps of one request between its engine outputs."""

    __slots__ = (
        "_detokenizers",
        "_gateway",
        "_open_choices",
        "_stop_string_matched",
        "_choices_to_abort",
        "job",
        "outputs",
        "outcome",
        "last_token_s",
        "path",
        "itl",
        "plain",
        "detokenizer",
    )

    def __init__(self, gateway: Gateway, job: Job) -> None:
        request = job.engine_request
        self._gateway = gateway
        self.job = job
        self._detokenizers = [  # one per choice
            IncrementalDetokenizer(
                gateway.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=job.skip_special_tokens,
                stop=job.stop,
                include_stop_str_in_output=job.include_stop_str_in_output,
                keep_text=False,  # the response is built from the deltas
            )
            for _ in range(request.n)
        ]
        self._open_choices = set(range(request.n))
        self._stop_string_matched = False
        self._choices_to_abort: list[int] = []  # n > 1: choices a stop string ended
        self.outputs = gateway.backend.generate(request)
        record = job.record
        record.dispatch_s = time.perf_counter()
        gateway.observer.metrics.gateway.observe(record.dispatch_s - job.arrival_s)
        gateway.metrics.num_requests_in_flight += 1
        # abort | unavailable | error | stop-string | a finish reason (stop, length...)
        self.outcome = "abort"  # until a final output says otherwise
        self.last_token_s = 0.0  # perf_counter() of the latest token-bearing output
        self.path = "local"  # "remote" once the first token came from a prefill engine
        self.itl: LoopHistogram | None = None  # the path's inter-token histogram, once known
        self.plain = job.plain
        self.detokenizer = self._detokenizers[0]  # the common token's (choice 0's)

    def is_plain_token(self, output: EngineOutput) -> bool:
        """Whether ``output`` is the common token: a plain request past its first
        token, an output with tokens and nothing else. The caller then takes it
        itself: ``itl.observe``, ``last_token_s``, the count and ``detokenizer.update``
        (``take`` shows how; ``GenerationResponse._respond`` inlines it)."""
        return (
            self.plain
            and self.last_token_s != 0.0
            and output.finish_reason is None
            and output.timings is None
            and output.new_logprobs is None
            and output.prompt_logprobs is None
            and bool(output.new_token_ids)
        )

    def take(self, output: EngineOutput) -> Step | str | None:
        """What ``output`` adds: the common token's text (a ``str``), else
        ``step``'s answer."""
        if self.is_plain_token(output):
            now_s = time.perf_counter()
            self.itl.observe(now_s - self.last_token_s)  # type: ignore[union-attr]
            self.last_token_s = now_s
            self.job.num_output_tokens += len(output.new_token_ids)
            return self.detokenizer.update(output.new_token_ids)
        return self.step(output)

    def step(self, output: EngineOutput) -> Step | None:
        """What ``output`` adds to the response, the general way: timings, the
        first token's metrics, errors, stop strings, logprobs, echo, the finish.
        None: the output belongs to a choice that already ended (skip it). A
        step with ``error`` or ``last`` is the response's last. Afterwards,
        ``choices_to_abort()`` if ``has_choices_to_abort``."""
        job, metrics = self.job, self._gateway.metrics
        now_s = time.perf_counter()
        if output.timings is not None:
            job.record.add_timings(output.timings, now_s)
        if output.new_token_ids:
            if self.last_token_s:
                self.itl.observe(now_s - self.last_token_s)  # type: ignore[union-attr]
            else:
                # P's first token carries the KV handoff (Backend.generate)
                self.path = path = "remote" if output.kv_transfer_params else "local"
                metrics.time_to_first_token.observe(now_s - job.arrival_s, path)
                self.itl = metrics.inter_token_latency.by_path[path]
                job.record.first_token_s = now_s
                # The first output's prefix hit is the request's: under P/D it is
                # P's (tokens not computed); D's local hits only save reading
                # blocks from P, not computing them.
                job.num_cached_tokens = output.num_cached_tokens
            self.last_token_s = now_s
        if output.finish_reason is FinishReason.ERROR:
            self.outcome = "error"
            metrics.request_failed(job.request_id, output.error or "")
            return Step(error=output.error or "The engine failed the request.", last=True)
        if output.index not in self._open_choices:
            return None  # a choice that a stop string ended
        step = output_step(job, self._detokenizers[output.index], output)
        step.index = output.index
        if step.finish_reason is not None:
            self._open_choices.discard(output.index)
            step.last = not self._open_choices
            if output.finish_reason is None:  # a stop string: the engine goes on
                self._stop_string_matched = True
                if not step.last:
                    self._choices_to_abort.append(output.index)
            if step.last:
                # A stop-string match still needs an abort; else the backend is done.
                self.outcome = "stop-string" if self._stop_string_matched else step.finish_reason
        return step

    @property
    def has_choices_to_abort(self) -> bool:
        return bool(self._choices_to_abort)

    async def abort_choices(self) -> None:
        """Abort the choices a stop string ended while others go on (n > 1)."""
        while self._choices_to_abort:
            index = self._choices_to_abort.pop()
            await self._gateway.backend.abort_choice(self.job.request_id, index)

    def no_final_output(self) -> Step:
        """The backend's iterator ended before a final output: an error step."""
        self.outcome = "error"
        return Step(error=_NO_FINAL, last=True)

    async def close(self) -> None:
        """Close the backend's iterator, abort unless finished, record the request."""
        gateway, job = self._gateway, self.job
        metrics, request_id = gateway.metrics, job.request_id
        try:
            await self.outputs.aclose()
        finally:
            metrics.num_requests_in_flight -= 1
            outcome, path = self.outcome, self.path
            if outcome in ("abort", "stop-string"):
                await gateway.backend.abort(request_id)
            if outcome == "unavailable":
                metrics.rejected(503)
            else:
                metrics.num_prompt_tokens += job.num_prompt_tokens
                metrics.num_generation_tokens += job.num_output_tokens
                metrics.finished("stop" if outcome == "stop-string" else outcome)
                metrics.e2e_request_latency.observe(time.perf_counter() - job.arrival_s, path)
            record = job.record
            record.end_s = time.perf_counter()
            record.path, record.outcome = path, outcome
            record.num_output_tokens = job.num_output_tokens
            record.router_fields = gateway.backend.route_log_fields(request_id)
            gateway.observer.finished(record)
