"""The ASGI response of a generation request: SSE stream or one JSON body.

``GenerationResponse`` runs a prepared ``Job`` (``generation.py``) beside a
watcher of the ASGI receive channel, pulling the backend's outputs through
the job's ``RequestRun`` (``request_run.py``): when the client disconnects
(``http.disconnect``) or the job's deadline passes, the work is cancelled and
the run's ``close`` aborts the request on the backend; past the
deadline the client gets 504 (or, mid-stream, an error event). Bodies and
chunks come from the job's formatters (``formatting.py``); the ``_send_*``
helpers write the raw ASGI messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tandem.cluster.gateway import formatting, protocol
from tandem.cluster.gateway.backend import BackendUnavailable
from tandem.cluster.gateway.edge import sampling as edge_sampling
from tandem.wire.engine_protocol import EngineOutput, Logprobs

if TYPE_CHECKING:
    from tandem.cluster.gateway.generation import Gateway
    from tandem.cluster.gateway.job import Job, Step
    from tandem.cluster.gateway.request_run import RequestRun

logger = logging.getLogger(__name__)

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]
_LAST_WORDS_TIMEOUT_S = 1.0  # sending a deadline's error to a client

# Scope key of the server's own ``send``. Starlette wraps ``send`` in one coroutine per
# exception-handling layer (three here) only to learn whether a response has started; at
# one SSE event per token that was ~12% of the gateway's CPU. A stream's start goes through
# the wrappers (so they know), its body events go straight to the server. No middleware
# here transforms bodies; one that did (gzip) would have to see them.
SERVER_SEND = "tandem.server_send"


class GenerationResponse(Response):
    """Runs a ``Job`` and writes its response, stream or not.

    The work runs as a task while the server's own task watches ``receive``;
    whichever ends first wins. A disconnect cancels the work, whose cleanup
    aborts the request on the backend. Past the job's deadline the work is cancelled
    the same way and the client gets 504 (or, mid-stream, an error event).
    The request's slot (``RequestSlots``) is released when this ends.
    """

    def __init__(self, gateway: Gateway, job: Job) -> None:
        self.gateway = gateway
        self.job = job
        self.status_code = 200
        self.background = None
        self._headers_sent = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # One task per request besides the server's: the work. The server's task (this
        # one) is the watcher: it waits on ``receive`` until the client leaves, and the
        # work's end interrupts that wait by cancelling it (``_WatchEnd``), which this
        # frame takes back (``uncancel``). A second task, ``asyncio.wait`` and a gather
        # per request cost more than that (docs/benchmarks.md, issue #29).
        watcher = asyncio.current_task()
        work = asyncio.create_task(self._respond(send, scope.get(SERVER_SEND, send)))
        ended = _WatchEnd(watcher)
        work.add_done_callback(ended)
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
            ended.watching = False  # the client left: the work is cancelled below
        except asyncio.CancelledError:
            if not ended.fired or watcher.uncancel() > 0:  # type: ignore[union-attr]
                raise  # not (only) the work's end: the server is stopping
        finally:
            ended.watching = False
            if not work.done():
                work.cancel()  # client gone (or server shutting down)
                await asyncio.gather(work, return_exceptions=True)
            elif not work.cancelled():
                work.exception()  # retrieved (``_respond`` raises only when cancelled)
            self.gateway.slots.release()

    async def _respond(self, send: Send, body_send: Send) -> None:
        """The work task's coroutine: the job's run within its deadline; a
        non-streamed response is ``_collect``'s, a stream's loop runs here.

        The stream loop is inlined in this frame: every token resumes the task's
        coroutine chain, and at 256 streams each frame of it is a few cache
        lines per stream that no longer stay cached between the stream's turns
        (docs/benchmarks.md, issue #29); the chain is this frame, then the
        backend's generator. SSE: the start through ``send`` (the middleware
        chain), every body event through ``body_send`` (the server's; see
        ``SERVER_SEND``). The loop pulls the backend's outputs itself
        (``run.outputs``, no generator in between) and takes the common token
        on its short path: the inter-token observation (the histogram's
        ``observe`` inlined), the count, the detokenizer's short path and the
        text chunk as its fixed prefix plus the text's shared tail (``text_frame``,
        ``text_tails``: one concatenation, no encoding for a text seen before).
        Every other output is ``run.step``'s.

        Events of outputs that were ready together (``Backend.num_ready``) go
        out as one write: a gateway running behind its engines pays one write
        per stream per batch, not per token. The bytes are the same; the first
        token's write carries the stream's opening events, the last one's the
        usage chunk and ``[DONE]``; an error step ends the stream with an
        error event and ``[DONE]``."""
        job = self.job
        try:
            async with asyncio.timeout_at(job.deadline_s):
                run = unavailable = failed = None
                counted = 0  # the short path's tokens not yet added to the job's count
                try:
                    run = self.gateway.start(job)
                    output, unavailable = await _first_output(run)
                    if unavailable is None and not job.stream:
                        await self._collect(send, run, output)
                    elif unavailable is None:
                        # ---- the stream (see the docstring) ----
                        formatters, request_id = job.formatters, job.request_id
                        num_ready = self.gateway.backend.num_ready
                        self._headers_sent = True
                        await send(
                            {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
                        )
                        pending = b"".join(c for f in formatters for c in f.stream_start())
                        text_delta = formatters[0].stream_delta
                        frame = formatters[0].text_frame  # the text chunk's fixed bytes, if any
                        prefix = frame[0] if frame is not None else b""
                        tails = formatters[0].text_tails  # what follows ``prefix``, by text
                        tail_of = make_tail = None
                        if frame is not None and tails is not None:
                            tail_of, make_tail = tails.table.get, tails.make
                        # the backend's iterator and the detokenizer themselves, not bound
                        # methods of them: one object fewer per stream touched per token
                        outputs, detokenizer = run.outputs, run.detokenizer
                        plain, perf_counter = run.plain, time.perf_counter
                        # the run's inter-token clock, kept here between its steps, and the
                        # token count (``counted``) until the next general step: the run and
                        # the job are not touched per token
                        last_s, itl = run.last_token_s, run.itl
                        # the histogram's observe, inlined (``itl`` is known from the
                        # first token on, before any short-path token)
                        itl_counts = itl_bounds = None
                        if itl is not None:
                            itl_counts, itl_bounds = itl.counts, itl.bounds
                        while True:
                            if output is None:  # the backend ended without a final output
                                step: Step | None = run.no_final_output()
                            elif (
                                plain
                                and output.finish_reason is None
                                and output.timings is None
                                and output.new_logprobs is None
                                and output.prompt_logprobs is None
                                and (token_ids := output.new_token_ids)
                                and last_s
                            ):  # the common token (RequestRun.is_plain_token)
                                now_s = perf_counter()
                                gap_s = now_s - last_s
                                itl_counts[bisect_left(itl_bounds, gap_s)] += 1  # type: ignore
                                itl.sum += gap_s  # type: ignore[union-attr]
                                last_s = now_s
                                counted += len(token_ids)
                                text = detokenizer.update(token_ids)
                                if text:
                                    if tail_of is not None:
                                        tail = tail_of(text)
                                        if tail is None:
                                            tail = make_tail(text)  # type: ignore[misc]
                                        pending += prefix + tail
                                    else:
                                        pending += text_delta(text, None, None)
                                if pending and not num_ready(request_id):
                                    await body_send(
                                        {
                                            "type": "http.response.body",
                                            "body": pending,
                                            "more_body": True,
                                        }
                                    )
                                    pending = b""
                                try:
                                    output = await anext(outputs)
                                except StopAsyncIteration:
                                    output = None
                                continue
                            else:
                                job.num_output_tokens += counted
                                counted = 0
                                run.last_token_s = last_s
                                step = run.step(output)
                                last_s, itl = run.last_token_s, run.itl
                                if itl is not None:
                                    itl_counts, itl_bounds = itl.counts, itl.bounds
                                if run.has_choices_to_abort:
                                    await run.abort_choices()
                            if step is not None:
                                if step.error is not None:
                                    await _send_body(
                                        body_send, pending + _error_event(step.error), False
                                    )
                                    break
                                if step.text or step.logprobs or step.finish_reason is not None:
                                    pending += formatters[step.index].stream_delta(
                                        step.text, step.logprobs, step.finish_reason
                                    )
                                if step.last:
                                    await _send_body(body_send, pending + _tail(job), False)
                                    break
                                if pending and not num_ready(request_id):
                                    await _send_body(body_send, pending)
                                    pending = b""
                            try:
                                output = await anext(outputs)
                            except StopAsyncIteration:
                                output = None
                except (asyncio.CancelledError, OSError):
                    raise
                except Exception as exc:  # answered once the run is closed
                    failed = exc
                finally:
                    job.num_output_tokens += counted
                    if run is not None:  # the abort (unless finished), metrics, the record
                        await run.close()
                if unavailable is not None:
                    body = protocol.error_body(
                        str(unavailable), "service_unavailable", code="unavailable"
                    )
                    await _send_json(send, 503, body)
                elif failed is not None:
                    await self._failed(send, failed)
        except TimeoutError:
            await self._deadline_passed(send, body_send)

    async def _deadline_passed(self, send: Send, body_send: Send) -> None:
        # The work was cancelled, so the run's close() aborted the request.
        job = self.job
        logger.warning("request %s passed its deadline", job.request_id)
        timeout_s = self.gateway.limits.request_timeout_s
        body = protocol.error_body(
            f"The request did not finish within {timeout_s} s.",
            "timeout_error",
            code="request_timeout",
        )
        # A client that is not reading gets no more time than this.
        async with asyncio.timeout(_LAST_WORDS_TIMEOUT_S):
            if self._headers_sent:
                await _send_body(body_send, _last_events(body), False)
            else:
                await _send_json(send, 504, body)

    async def _failed(self, send: Send, exc: Exception) -> None:
        logger.error("request %s failed", self.job.request_id, exc_info=exc)
        body = protocol.error_body("Internal server error.", "server_error")
        if self._headers_sent:
            await _send_body(send, _last_events(body), more_body=False)
        else:
            await _send_json(send, 500, body)

    async def _collect(self, send: Send, run: RequestRun, output: EngineOutput | None) -> None:
        job = self.job
        texts: list[list[str]] = [[] for _ in job.formatters]  # per choice
        logprobs: list[list[Logprobs]] = [[] for _ in job.formatters]
        finish_reasons: list[str | None] = [None for _ in job.formatters]
        next_output = run.outputs.__anext__
        while True:
            step = run.no_final_output() if output is None else run.take(output)
            if step.__class__ is str:  # the common token: choice 0's text
                texts[0].append(step)  # type: ignore[arg-type]
            elif step is not None:
                if run.has_choices_to_abort:
                    await run.abort_choices()
                if step.error is not None:
                    body = protocol.error_body(step.error, "server_error", code="engine_error")
                    await _send_json(send, 500, body)
                    return
                texts[step.index].append(step.text)
                logprobs[step.index].extend(step.logprobs or ())
                finish_reasons[step.index] = step.finish_reason
                if step.last:
                    break
            try:
                output = await next_output()
            except StopAsyncIteration:
                output = None
        usage = formatting.usage(
            job.num_prompt_tokens, job.num_output_tokens, job.num_cached_tokens
        )
        prompt_logprobs = None
        if job.want_prompt_logprobs:
            token_text = self.gateway.token_text
            prompt_logprobs = edge_sampling.prompt_logprobs_body(job.prompt_logprobs, token_text)
        choices = [
            f.choice("".join(t), lp, fin)
            for f, t, lp, fin in zip(job.formatters, texts, logprobs, finish_reasons, strict=True)
        ]
        body = job.formatter.response_choices(choices, usage, prompt_logprobs)
        await _send_bytes(send, 200, body)


async def _first_output(run: RequestRun) -> tuple[EngineOutput | None, Exception | None]:
    """The run's first output (None: the backend's iterator ended at once) or the
    ``BackendUnavailable`` it raised before any (the client gets 503)."""
    try:
        return await anext(run.outputs), None
    except StopAsyncIteration:
        return None, None
    except BackendUnavailable as exc:  # only ever before the first output
        run.outcome = "unavailable"
        return None, exc


def _last_events(body: dict[str, Any]) -> bytes:
    """An error ``body`` as a stream's last events: its event, then ``[DONE]``."""
    return formatting.sse(body) + formatting.SSE_DONE


def _error_event(message: str) -> bytes:
    return _last_events(protocol.error_body(message, "server_error", code="engine_error"))


def _tail(job: Job) -> bytes:
    """A stream's last events: the usage chunk if asked for, then ``[DONE]``."""
    if not job.include_usage:
        return formatting.SSE_DONE
    usage = formatting.usage(job.num_prompt_tokens, job.num_output_tokens, job.num_cached_tokens)
    return job.formatter.stream_usage(usage) + formatting.SSE_DONE


class _WatchEnd:
    """The work task's done callback: it ends the watcher's wait on ``receive``
    (cancels it) unless the watcher already stopped watching."""

    __slots__ = ("fired", "task", "watching")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.watching = True
        self.fired = False

    def __call__(self, _work: asyncio.Task) -> None:
        if self.watching:
            self.fired = True
            self.task.cancel()  # type: ignore[union-attr]


async def _send_body(send: Send, body: bytes, more_body: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more_body})


async def _send_json(send: Send, status_code: int, payload: dict[str, Any]) -> None:
    await _send_bytes(send, status_code, formatting.encode_json(payload))


async def _send_bytes(send: Send, status_code: int, body: bytes) -> None:
    headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status_code, "headers": headers})
    await _send_body(send, body, more_body=False)
