"""The HTTP front door: OpenAI-compatible completions over a ``Backend``.

    POST /v1/completions, /v1/chat/completions   (stream and not)
    GET  /v1/models, /health, /metrics, /openapi.json
    POST /tokenize, /detokenize                   (cluster/gateway/api/tokenize.py)

Per request:

    parse + validate (protocol) -> tokenize -> EngineRequest
    -> backend.generate() -> detokenize + stop strings -> SSE chunks / JSON body

The response runs next to a watcher of the ASGI receive channel: when the
client disconnects (``http.disconnect``) the work is cancelled and the
request is aborted on the backend. A matched stop string also aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import inspect
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from cluster.gateway import protocol
from cluster.gateway.api.admin import add_admin_routes
from cluster.gateway.api.config import ApiConfig, ServedModels
from cluster.gateway.api.openapi import openapi_schema
from cluster.gateway.api.tokenize import add_tokenize_routes
from cluster.gateway.backend import Backend, BackendUnavailable
from cluster.gateway.edge import sampling as edge_sampling
from cluster.gateway.edge.limits import GatewayLimits, RequestSlots, read_body
from cluster.gateway.edge.tokenizer_pool import TokenizerPool, chat_text_len
from cluster.gateway.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from cluster.observability import dashboard
from cluster.observability.logging_setup import REQUEST_ID
from cluster.observability.metrics import EngineMetricsCollector, GatewayMetrics, render
from cluster.observability.tracing.observer import RequestObserver, Tracer
from cluster.observability.tracing.phase_metrics import RequestPhaseMetrics
from cluster.observability.tracing.record import TRACEPARENT, RequestRecord
from wire.engine_protocol import EngineOutput, EngineRequest, FinishReason, Logprobs, SamplingParams
from workers.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]
_LAST_WORDS_TIMEOUT_S = 1.0  # sending a deadline's error to a client


# We export Prometheus metrics ourselves; FastAPI's OpenTelemetry hooks (newer
# releases) would cost per request if a provider happened to be configured.
_NO_OTEL: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


# Scope key of the server's own ``send``. Starlette wraps ``send`` in one coroutine per
# exception-handling layer (three here) only to learn whether a response has started; at
# one SSE event per token that was ~12% of the gateway's CPU. A stream's start goes through
# the wrappers (so they know), its body events go straight to the server. No middleware
# here transforms bodies; one that did (gzip) would have to see them.
_SERVER_SEND = "tandem.server_send"


class _GatewayApp(FastAPI):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[_SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(
    backend: Backend,
    *,
    api_key: str | None = None,
    limits: GatewayLimits | None = None,
    api: ApiConfig | None = None,
    tracer: Tracer | None = None,
    admin_api_key: str | None = None,
) -> FastAPI:
    """The gateway app. ``api_key`` (if set) is required on ``/v1/*``,
    ``/tokenize``, ``/detokenize`` and ``/cluster/state`` (``cluster/observability/dashboard/``)
    as ``Authorization: Bearer <key>``; ``/health``, ``/metrics``,
    ``/openapi.json`` and the ``/dashboard`` page stay open.
    ``limits``: body size, concurrency, deadline, tokenizer threads
    (``cluster.gateway.edge.limits``; defaults when None). ``api``: served model
    names, chat template, generation defaults (``cluster.gateway.api.config``). ``tracer``: exports each
    finished request's spans (``cluster.observability.tracing.otel.OtelTracer``); None = off.
    ``admin_api_key`` opens ``/admin/*`` (``cluster.gateway.api.admin``: drain an engine)."""
    limits = limits or GatewayLimits()
    api = api or ApiConfig()
    if api.chat_template is not None:
        backend.tokenizer.chat_template = api.chat_template  # the gateway renders chats
    registry = CollectorRegistry()
    gateway = Gateway(backend, GatewayMetrics(), limits, api, tracer=tracer)
    registry.register(gateway.metrics)
    registry.register(gateway.observer.metrics)
    registry.register(EngineMetricsCollector(backend))
    app = _GatewayApp(title="tandem", docs_url=None, redoc_url=None, openapi_url=None, **_NO_OTEL)
    app.state.gateway = gateway

    # constant-time comparison: the key's prefix cannot be learned by timing
    expected_authorization = f"Bearer {api_key}".encode()

    def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if api_key is not None and not hmac.compare_digest(given, expected_authorization):
            raise ProtocolError(
                "Invalid or missing API key.",
                status_code=401,
                type="authentication_error",
                code="invalid_api_key",
            )

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: Request, exc: ProtocolError) -> Response:
        if request.url.path.startswith("/v1/") and request.method == "POST":
            gateway.metrics.rejected(exc.status_code)
        headers = getattr(exc, "headers", None)
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(protocol.error_body(str(exc), "invalid_request_error"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(exc.detail), kind), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(protocol.error_body("Internal server error.", "server_error"), 500)

    # Generation routes are plain Starlette routes: FastAPI's dependency
    # solving would add ~0.2 ms per request and they take no parameters.
    # Each holds a request slot from arrival to the end of its response
    # (GenerationResponse releases it); a refusal before that releases it here.
    def generation_route(request_type: type, prepare: Callable) -> Callable:
        async def route(request: Request) -> Response:
            arrival_s = time.perf_counter()
            check_api_key(request)
            if tracer is not None:
                TRACEPARENT.set(request.headers.get("traceparent"))
            gateway.slots.acquire()
            try:
                body = await read_body(request, limits.max_request_body_bytes)
                req = protocol.decode_request(body, request_type)
                return await prepare(req, arrival_s)
            except BaseException:
                gateway.slots.release()
                raise

        return route

    completions = generation_route(CompletionRequest, gateway.prepare_completion)
    chat_completions = generation_route(ChatCompletionRequest, gateway.prepare_chat)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    add_tokenize_routes(app, gateway, check_api_key)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_api_key(request)
        cards = [
            {
                "id": name,
                "object": "model",
                "created": gateway.started_at,
                "owned_by": "tandem",
                "root": backend.model_name,
                "max_model_len": backend.max_model_len,
                "vocab_size": gateway.vocab_size,
            }
            for name in gateway.models.names
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/openapi.json")
    async def openapi() -> Response:
        # built per call: max_model_len is known only once the engines are ready
        schema = openapi_schema(
            gateway.models.names, gateway.vocab_size, limits.max_logprobs, api_key is not None
        )
        return JSONResponse(schema)

    @app.get("/health")
    async def health() -> Response:
        ready, reason = backend.is_ready()
        if ready:
            degraded = backend.degraded()  # serving, with an engine down or drained
            if degraded:
                return JSONResponse({"status": "degraded", "reason": degraded})
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        rolling.ensure_started()
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    rolling = dashboard.install(app, backend, gateway.metrics, check_api_key)

    add_admin_routes(app, backend, admin_api_key)
    return app


@dataclasses.dataclass(slots=True)
class _Job:
    """One validated request, ready to dispatch."""

    engine_request: EngineRequest
    formatter: protocol.CompletionFormatter | protocol.ChatFormatter
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


@dataclasses.dataclass(slots=True)
class _Step:
    """What one engine output adds to the response."""

    text: str = ""
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0  # the choice
    last: bool = False  # every choice has finished: the response's last step


class Gateway:
    """Request preparation and the generation loop, independent of routes."""

    def __init__(
        self,
        backend: Backend,
        metrics: GatewayMetrics,
        limits: GatewayLimits | None = None,
        api: ApiConfig | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.backend = backend
        self.api = api = api or ApiConfig()
        self.models = ServedModels(api.served_model_names, backend.model_name)
        self.metrics = metrics
        self.observer = RequestObserver(RequestPhaseMetrics(), tracer)
        self.limits = limits = limits or GatewayLimits()
        self.slots = RequestSlots(limits.max_num_requests, limits.retry_after_s)
        self.tokenizer = backend.tokenizer
        self.tokenizer_pool = TokenizerPool(backend.tokenizer, limits.tokenizer_workers)
        self.vocab_size = len(backend.tokenizer)
        self.started_at = int(time.time())
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- preparation (raises ProtocolError) ----

    async def prepare_completion(self, req: CompletionRequest, arrival_s: float) -> Response:
        model = self.models.resolve(req.model)
        protocol.validate_common(req, model)
        prompt = protocol.completion_prompt(req)
        edge_sampling.check_num_logprobs(req.logprobs, "logprobs", self.limits.max_logprobs)
        if isinstance(prompt, str):
            self.tokenizer_pool.check_text_len(len(prompt), self.backend.max_model_len, "prompt")
            prompt_ids = await self.tokenizer_pool.encode(prompt)
        else:
            prompt_ids = self._check_token_ids(prompt)
        self._check_prompt_len(prompt_ids)
        self.api.generation_defaults.apply(req, self.backend.max_model_len - len(prompt_ids))
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        self._check_total_len(prompt_ids, max_tokens, "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        formatter = protocol.CompletionFormatter(
            request_id, model, int(time.time()), req.logprobs, self.token_text
        )
        params = protocol.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
        echo_text = None
        if req.echo:
            echo_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
            if req.logprobs is not None:  # the echoed tokens carry logprobs too
                num_top = max(req.prompt_logprobs or 0, req.logprobs)
                params = msgspec.structs.replace(params, prompt_logprobs=num_top)
        return self._response(req, prompt_ids, params, formatter, arrival_s, echo_text)

    async def prepare_chat(self, req: ChatCompletionRequest, arrival_s: float) -> Response:
        model = self.models.resolve(req.model)
        protocol.validate_common(req, model)
        protocol.check_chat_fields(req)
        num_logprobs = protocol.chat_logprobs(req)
        edge_sampling.check_num_logprobs(req.top_logprobs, "top_logprobs", self.limits.max_logprobs)
        num_chars = chat_text_len(req.messages)
        self.tokenizer_pool.check_text_len(num_chars, self.backend.max_model_len, "messages")
        try:
            prompt_ids = await self.tokenizer_pool.chat(req.messages, req.add_generation_prompt)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="messages") from None
        self._check_prompt_len(prompt_ids, param="messages")
        self.api.generation_defaults.apply(req, self.backend.max_model_len - len(prompt_ids))
        max_tokens = req.max_completion_tokens or req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        if max_tokens is None:
            max_tokens = self.backend.max_model_len - len(prompt_ids)
        else:
            self._check_total_len(prompt_ids, max_tokens, param)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        formatter = protocol.ChatFormatter(
            request_id, model, int(time.time()), num_logprobs, self.token_text
        )
        params = protocol.sampling_params(req, max_tokens=max_tokens, logprobs=num_logprobs)
        return self._response(req, prompt_ids, params, formatter, arrival_s)

    def _response(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        formatter: protocol.CompletionFormatter | protocol.ChatFormatter,
        arrival_s: float,
        echo_text: str | None = None,
    ) -> Response:
        self._check_token_ids(params.stop_token_ids, param="stop_token_ids")
        max_logprobs = self.limits.max_logprobs
        edge_sampling.check_num_logprobs(req.prompt_logprobs, "prompt_logprobs", max_logprobs)
        params = edge_sampling.with_token_fields(params, req, self.tokenizer, self.vocab_size)
        deadline_s = None
        if self.limits.request_timeout_s:
            elapsed_s = time.perf_counter() - arrival_s
            deadline_s = (
                asyncio.get_running_loop().time() + self.limits.request_timeout_s - elapsed_s
            )
        REQUEST_ID.set(formatter.request_id)  # every later log line of this request
        chat = isinstance(formatter, protocol.ChatFormatter)
        record = RequestRecord(
            formatter.request_id,
            "chat.completions" if chat else "completions",
            arrival_s,
            time.time_ns() - int((time.perf_counter() - arrival_s) * 1e9),
            len(prompt_ids),
            traceparent=TRACEPARENT.get(),
        )
        job = _Job(
            engine_request=EngineRequest(
                formatter.request_id,
                prompt_ids,
                params,
                arrival_time=time.time(),
                cache_salt=req.cache_salt,
                priority=req.priority,
                n=req.n,
            ),
            formatter=formatter,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            stop=protocol.stop_strings(req),
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            arrival_s=arrival_s,
            deadline_s=deadline_s,
            formatters=[formatter, *(formatter.for_choice(i) for i in range(1, req.n))],
            echo_text=echo_text,
            echo_logprobs=echo_text is not None and params.logprobs is not None,
            want_prompt_logprobs=req.prompt_logprobs is not None,
            record=record,
        )
        return GenerationResponse(self, job)

    def _check_token_ids(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ProtocolError(
                    f"Token id {token_id} is out of range [0, {self.vocab_size}).", param=param
                )
        return token_ids

    def _check_prompt_len(self, prompt_ids: list[int], param: str = "prompt") -> None:
        if not prompt_ids:
            raise ProtocolError("The prompt is empty.", param=param)
        if len(prompt_ids) >= self.backend.max_model_len:
            raise ProtocolError(
                f"The prompt has {len(prompt_ids)} tokens; the model's context length is "
                f"{self.backend.max_model_len}, which leaves no room to generate.",
                param=param,
                code="context_length_exceeded",
            )

    def _check_total_len(self, prompt_ids: list[int], max_tokens: int, param: str) -> None:
        if len(prompt_ids) + max_tokens > self.backend.max_model_len:
            raise ProtocolError(
                f"This model's maximum context length is {self.backend.max_model_len} tokens; "
                f"the request asks for {len(prompt_ids)} prompt + {max_tokens} output tokens.",
                param=param,
                code="context_length_exceeded",
            )

    # ---- generation ----

    async def run(self, job: _Job) -> AsyncIterator[_Step]:
        """The request's steps; the last has ``finish_reason`` or ``error``.

        Raises ``BackendUnavailable`` before the first step. If the consumer
        stops early (stop string, disconnect, cancellation) the request is
        aborted on the backend.
        """
        metrics = self.metrics
        request = job.engine_request
        detokenizers = [  # one per choice
            IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=job.skip_special_tokens,
                stop=job.stop,
                include_stop_str_in_output=job.include_stop_str_in_output,
            )
            for _ in range(request.n)
        ]
        open_choices = set(range(request.n))
        stop_string_matched = False
        outputs = self.backend.generate(request)
        record = job.record
        record.dispatch_s = time.perf_counter()
        self.observer.metrics.gateway.observe(record.dispatch_s - job.arrival_s)
        metrics.num_requests_in_flight += 1
        outcome = "abort"  # until a final output says otherwise
        last_token_s = 0.0
        path = "local"  # "remote" once the first token came from a prefill engine
        try:
            async for output in outputs:
                now_s = time.perf_counter()
                if output.timings is not None:
                    record.add_timings(output.timings, now_s)
                if output.new_token_ids:
                    if last_token_s:
                        metrics.inter_token_latency.observe(now_s - last_token_s, path)
                    else:
                        # P's first token carries the KV handoff (Backend.generate)
                        path = "remote" if output.kv_transfer_params else "local"
                        metrics.time_to_first_token.observe(now_s - job.arrival_s, path)
                        record.first_token_s = now_s
                        # The first output's prefix hit is the request's: under P/D
                        # it is P's (tokens not computed); D's local hits only save
                        # reading blocks from P, not computing them.
                        job.num_cached_tokens = output.num_cached_tokens
                    last_token_s = now_s
                if output.finish_reason is FinishReason.ERROR:
                    outcome = "error"
                    metrics.request_failed(request.request_id, output.error or "")
                    yield _Step(error=output.error or "The engine failed the request.")
                    return
                if output.index not in open_choices:
                    continue  # a choice that a stop string ended
                step = self._step(job, detokenizers[output.index], output)
                step.index = output.index
                if step.finish_reason is not None:
                    open_choices.discard(output.index)
                    step.last = not open_choices
                    if output.finish_reason is None:  # a stop string: the engine goes on
                        stop_string_matched = True
                        if not step.last:
                            await self.backend.abort_choice(request.request_id, output.index)
                    if step.last:
                        # A stop-string match still needs an abort; else the backend is done.
                        outcome = "stop-string" if stop_string_matched else step.finish_reason
                yield step
                if step.last:
                    return
            outcome = "error"
            yield _Step(error="The backend ended the request without a final output.")
        except BackendUnavailable:
            outcome = "unavailable"
            raise
        finally:
            await outputs.aclose()
            metrics.num_requests_in_flight -= 1
            if outcome in ("abort", "stop-string"):
                await self.backend.abort(request.request_id)
            if outcome == "unavailable":
                metrics.rejected(503)
            else:
                metrics.num_prompt_tokens += job.num_prompt_tokens
                metrics.num_generation_tokens += job.num_output_tokens
                reason = "stop" if outcome == "stop-string" else outcome
                metrics.finished(reason)
                metrics.e2e_request_latency.observe(time.perf_counter() - job.arrival_s, path)
            record.end_s = time.perf_counter()
            record.path, record.outcome = path, outcome
            record.num_output_tokens = job.num_output_tokens
            record.router_fields = self.backend.route_log_fields(request.request_id)
            self.observer.finished(record)

    def _step(self, job: _Job, detokenizer: IncrementalDetokenizer, output: EngineOutput) -> _Step:
        token_ids = output.new_token_ids
        finish = output.finish_reason
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
        return _Step(text, logprobs, finish_reason)


class GenerationResponse(Response):
    """Runs a ``_Job`` and writes its response, stream or not.

    The work runs as a task beside a watcher of ``receive``; whichever ends
    first wins. A disconnect cancels the work, whose cleanup aborts the
    request on the backend. Past the job's deadline the work is cancelled
    the same way and the client gets 504 (or, mid-stream, an error event).
    The request's slot (``RequestSlots``) is released when this ends.
    """

    def __init__(self, gateway: Gateway, job: _Job) -> None:
        self.gateway = gateway
        self.job = job
        self.status_code = 200
        self.background = None
        self._headers_sent = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.create_task(self._respond(send, scope.get(_SERVER_SEND, send)))
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()  # client gone (or server shutting down)
            await asyncio.gather(work, watcher, return_exceptions=True)
            self.gateway.slots.release()

    async def _respond(self, send: Send, body_send: Send) -> None:
        try:
            async with asyncio.timeout_at(self.job.deadline_s):
                await self._respond_in_time(send, body_send)
        except TimeoutError:
            # The work was cancelled, so run()'s cleanup aborted the request.
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
                    await _send_body(body_send, protocol.sse(body) + protocol.SSE_DONE, False)
                else:
                    await _send_json(send, 504, body)

    async def _respond_in_time(self, send: Send, body_send: Send) -> None:
        job = self.job
        try:
            async with aclosing(self.gateway.run(job)) as steps:
                try:
                    first = await anext(steps)
                except BackendUnavailable as exc:
                    body = protocol.error_body(str(exc), "service_unavailable", code="unavailable")
                    await _send_json(send, 503, body)
                    return
                if job.stream:
                    self._headers_sent = True
                    await self._stream(send, body_send, first, steps)
                else:
                    await self._collect(send, first, steps)
        except (asyncio.CancelledError, OSError):
            raise
        except Exception:
            logger.exception("request %s failed", job.request_id)
            body = protocol.error_body("Internal server error.", "server_error")
            if self._headers_sent:
                await _send_body(send, protocol.sse(body) + protocol.SSE_DONE, more_body=False)
            else:
                await _send_json(send, 500, body)

    async def _stream(
        self, send: Send, body_send: Send, step: _Step, steps: AsyncIterator[_Step]
    ) -> None:
        """SSE: the start through ``send`` (the middleware chain), every body event
        through ``body_send`` (the server's; see ``_SERVER_SEND``)."""
        job, formatter = self.job, self.job.formatter
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        for chunk in (c for f in job.formatters for c in f.stream_start()):
            await _send_body(body_send, chunk)
        while True:
            if step.error is not None:
                body = protocol.error_body(step.error, "server_error", code="engine_error")
                await _send_body(body_send, protocol.sse(body) + protocol.SSE_DONE, more_body=False)
                return
            if step.text or step.logprobs or step.finish_reason is not None:
                chunk = job.formatters[step.index].stream_delta(
                    step.text, step.logprobs, step.finish_reason
                )
                await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
            if step.last:
                break
            step = await anext(steps)
        tail = protocol.SSE_DONE
        if job.include_usage:
            usage = protocol.usage(
                job.num_prompt_tokens, job.num_output_tokens, job.num_cached_tokens
            )
            tail = formatter.stream_usage(usage) + tail
        await _send_body(body_send, tail, more_body=False)

    async def _collect(self, send: Send, step: _Step, steps: AsyncIterator[_Step]) -> None:
        job = self.job
        texts: list[list[str]] = [[] for _ in job.formatters]  # per choice
        logprobs: list[list[Logprobs]] = [[] for _ in job.formatters]
        finish_reasons: list[str | None] = [None for _ in job.formatters]
        while True:
            if step.error is not None:
                body = protocol.error_body(step.error, "server_error", code="engine_error")
                await _send_json(send, 500, body)
                return
            texts[step.index].append(step.text)
            logprobs[step.index].extend(step.logprobs or ())
            finish_reasons[step.index] = step.finish_reason
            if step.last:
                break
            step = await anext(steps)
        usage = protocol.usage(job.num_prompt_tokens, job.num_output_tokens, job.num_cached_tokens)
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


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_body(send: Send, body: bytes, more_body: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more_body})


async def _send_json(send: Send, status_code: int, payload: dict[str, Any]) -> None:
    await _send_bytes(send, status_code, protocol.encode_json(payload))


async def _send_bytes(send: Send, status_code: int, body: bytes) -> None:
    headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status_code, "headers": headers})
    await _send_body(send, body, more_body=False)


@contextlib.contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", timeout_s: float = 10.0) -> Iterator[str]:
    """Run ``app`` under uvicorn in a background thread on a free port; yield
    its base URL (``http://host:port``); stop the server on exit. For tests
    and embedding."""
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets
    # only then; without it every keep-alive response waits ~40 ms (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline_s = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline_s:
                raise RuntimeError("gateway server did not start")
            time.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()
