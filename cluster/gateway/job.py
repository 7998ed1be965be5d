"""A prepared request (``Job``) and what each engine output adds to its
response (``Step``, made by ``output_step``).

``generation.Gateway`` builds the ``Job`` and runs it; ``output_step`` turns
one ``EngineOutput`` into text through the choice's incremental detokenizer,
applying stop strings, the hidden EOS / stop token, logprobs and echo.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.cluster.gateway import formatting
from tandem.cluster.gateway.edge import sampling as edge_sampling
from tandem.cluster.observability.tracing.record import RequestRecord
from tandem.wire.engine_protocol import EngineOutput, EngineRequest, FinishReason, Logprobs
from tandem.workers.text.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass(slots=True)
class Job:
    """One validated request, ready to dispatch."""

    engine_request: EngineRequest
    formatter: formatting.CompletionFormatter | formatting.ChatFormatter
    stream: bool
    include_usage: bool
    stop: list[str]
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    arrival_s: float  # time.perf_counter() when the HTTP request arrived
    deadline_s: float | None  # event-loop time after which the request is cut (504)
    record: RequestRecord  # where its time went (cluster/observability/tracing)
    num_output_tokens: int = 0  # every choice's
    num_cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    # one per choice (n > 1: the same response, each its own "index")
    formatters: list[Any] = dataclasses.field(default_factory=list)
    echo_text: str | None = None  # prompt text put before each choice's output (echo)
    echoed: set[int] = dataclasses.field(default_factory=set)  # choices echoed so far
    echo_logprobs: bool = False  # the echoed prompt carries logprobs
    want_prompt_logprobs: bool = False  # the client asked for prompt_logprobs
    prompt_logprobs: list[Logprobs] | None = None  # from the first output with tokens

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)

    @property
    def plain(self) -> bool:
        """One choice, no stop strings, echo or prompt logprobs: then an output with tokens
        and nothing else (no finish, timings or logprobs) adds its text alone, and
        ``RequestRun.take`` makes its step without ``output_step``."""
        return (
            self.engine_request.n == 1
            and not self.stop
            and self.echo_text is None
            and not self.want_prompt_logprobs
        )


@dataclasses.dataclass(slots=True)
class Step:
    """What one engine output adds to the response."""

    text: str = ""
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0  # the choice
    last: bool = False  # every choice has finished: the response's last step


def output_step(job: Job, detokenizer: IncrementalDetokenizer, output: EngineOutput) -> Step:
    """What ``output`` adds to ``job``'s response: its text (stop strings and EOS
    applied), logprobs and finish reason; counts its tokens on ``job``."""
    token_ids = output.new_token_ids
    finish = output.finish_reason
    if (
        finish is None
        and not job.stop
        and output.new_logprobs is None
        and output.prompt_logprobs is None
        and job.echo_text is None
    ):  # the common token: its text only (no stop string can match without stops)
        job.num_output_tokens += len(token_ids)
        return Step(detokenizer.update(token_ids) if token_ids else "")
    # EOS / stop token: counted, not shown (Backend.generate contract).
    text_ids = token_ids[:-1] if finish is FinishReason.STOP and token_ids else token_ids
    if job.stop:
        # One token at a time, to know which token completed the stop string.
        parts = []
        for num_consumed, token_id in enumerate(text_ids, 1):
            parts.append(detokenizer.update([token_id]))
            if detokenizer.stop_matched is not None:
                token_ids = token_ids[:num_consumed]
                break
        text = "".join(parts)
    else:
        text = detokenizer.update(text_ids) if text_ids else ""
    finish_reason = None
    if detokenizer.stop_matched is not None:
        finish_reason = "stop"
    elif finish is not None:
        finish_reason = str(finish)
        text += detokenizer.finish()
    job.num_output_tokens += len(token_ids)
    logprobs = output.new_logprobs
    if logprobs is not None and len(logprobs) > len(token_ids):
        logprobs = logprobs[: len(token_ids)]
    if output.prompt_logprobs is not None:
        job.prompt_logprobs = output.prompt_logprobs
    if job.echo_text is not None and output.index not in job.echoed:
        # the choice's first output: the prompt goes first
        job.echoed.add(output.index)
        text = job.echo_text + text
        if job.echo_logprobs:
            prompt_ids = job.engine_request.prompt_token_ids
            echoed = edge_sampling.echo_logprobs(prompt_ids, job.prompt_logprobs)
            logprobs = echoed + (logprobs or [])
    return Step(text, logprobs, finish_reason)
