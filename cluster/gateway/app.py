"""The HTTP front door: the FastAPI app and its routes over a ``Backend``.

    POST /v1/completions, /v1/chat/completions   (stream and not)
    GET  /v1/models, /health, /metrics, /openapi.json
    POST /tokenize, /detokenize                   (cluster/gateway/api/tokenize.py)

Per request:

    parse + validate (protocol) -> tokenize -> EngineRequest       (generation)
    -> backend.generate() -> detokenize + stop strings              (generation)
    -> SSE chunks / JSON body (formatting), written by the ASGI response (responses)

The generation routes hold a request slot and decode the body here; the
rest is ``generation.Gateway``'s. ``serve_in_thread`` runs an app under
uvicorn in a thread (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tandem.cluster.gateway import protocol
from tandem.cluster.gateway.api.admin import add_admin_routes
from tandem.cluster.gateway.api.config import ApiConfig
from tandem.cluster.gateway.api.openapi import openapi_schema
from tandem.cluster.gateway.api.tokenize import add_tokenize_routes
from tandem.cluster.gateway.backend import Backend
from tandem.cluster.gateway.edge.limits import GatewayLimits, read_body
from tandem.cluster.gateway.generation import Gateway
from tandem.cluster.gateway.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from tandem.cluster.gateway.responses import SERVER_SEND
from tandem.cluster.observability import dashboard
from tandem.cluster.observability.gateway_peers import GatewayPeers
from tandem.cluster.observability.metrics import EngineMetricsCollector, GatewayMetrics, render
from tandem.cluster.observability.peer_load_metrics import PeerLoadCollector
from tandem.cluster.observability.tracing.observer import Tracer
from tandem.cluster.observability.tracing.record import TRACEPARENT

logger = logging.getLogger(__name__)


# We export Prometheus metrics ourselves; FastAPI's OpenTelemetry hooks (newer
# releases) would cost per request if a provider happened to be configured.
_NO_OTEL: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


class _GatewayApp(FastAPI):
    """FastAPI with the generation routes dispatched ahead of Starlette's stack.

    ``POST /v1/completions`` and ``/v1/chat/completions`` go straight to their
    handlers (``generation_routes``, set by ``create_app``), which apply the same
    exception handlers the middleware would: Starlette's router and its four
    middleware layers (server errors, telemetry, exceptions, FastAPI's exit stack)
    cost 15-20 us per request and do nothing for these routes (docs/benchmarks.md,
    issue #29). Every other route, and these under a ``root_path``, take the
    usual way. The routes are registered in the app as well (``app.routes``).
    Once the app has middleware of its own (``add_middleware``, however late), every
    route takes the usual way, so that the middleware sees the generation routes too."""

    generation_routes: Mapping[str, Callable[[Scope, Receive, Send], Any]] = MappingProxyType({})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and not self.user_middleware
        ):
            handler = self.generation_routes.get(scope["path"])
            if handler is not None:
                scope["app"] = self
                await handler(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(
    backend: Backend,
    *,
    api_key: str | None = None,
    limits: GatewayLimits | None = None,
    api: ApiConfig | None = None,
    tracer: Tracer | None = None,
    admin_api_key: str | None = None,
    gateway_index: int | None = None,
    share_dir: str | None = None,
) -> FastAPI:
    """The gateway app. ``api_key`` (if set) is required on ``/v1/*``,
    ``/tokenize``, ``/detokenize`` and ``/cluster/state`` (``cluster/observability/dashboard/``)
    as ``Authorization: Bearer <key>``; ``/health``, ``/metrics``,
    ``/openapi.json`` and the ``/dashboard`` page stay open.
    ``limits``: body size, concurrency, deadline, tokenizer threads
    (``cluster.gateway.edge.limits``; defaults when None). ``api``: served model
    names, chat template, generation defaults (``cluster.gateway.api.config``). ``tracer``: exports each
    finished request's spans (``cluster.observability.tracing.otel.OtelTracer``); None = off.
    ``admin_api_key`` opens ``/admin/*`` (``cluster.gateway.api.admin``: drain an engine).
    ``gateway_index``: this gateway's index among ``--api-server-count``'s
    (``/health`` names it, so a client can tell which one answered);
    with ``share_dir`` the gateways share their figures there, and
    ``/metrics`` and ``/cluster/state`` answer for all of them
    (``cluster/observability/gateway_peers.py``)."""
    limits = limits or GatewayLimits()
    api = api or ApiConfig()
    if api.chat_template is not None:
        backend.tokenizer.chat_template = api.chat_template  # the gateway renders chats
    registry = CollectorRegistry()
    gateway = Gateway(backend, GatewayMetrics(), limits, api, tracer=tracer)
    peers = None
    # this gateway's own figures; the engines' (and the router's per engine) are cluster-wide
    own = (gateway.observer.metrics, PeerLoadCollector(backend))
    if share_dir is not None and gateway_index is not None:
        peers = GatewayPeers(share_dir, gateway_index, gateway.metrics, own)
        registry.register(peers)  # every gateway's own figures, labelled gateway="i"
    else:
        registry.register(gateway.metrics)
        for collector in own:
            registry.register(collector)
    registry.register(EngineMetricsCollector(backend))
    app = _GatewayApp(title="tandem", docs_url=None, redoc_url=None, openapi_url=None, **_NO_OTEL)
    app.state.gateway = gateway

    # constant-time comparison: the key's prefix cannot be learned by timing
    expected_authorization = f"Bearer {api_key}".encode()

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected_authorization):
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

    def direct(route: Callable) -> Callable[[Scope, Receive, Send], Any]:
        """``route`` as an ASGI app with the handlers the middleware stack would apply:
        a ``ProtocolError`` answers in its envelope; anything else is logged and
        answered 500 (unless the response started) and raised on to the server, as
        Starlette's ``ServerErrorMiddleware`` does."""

        async def handle(scope: Scope, receive: Receive, send: Send) -> None:
            request = Request(scope, receive, send)
            started = False

            async def start_send(message: dict[str, Any]) -> None:  # the body bypasses it
                nonlocal started
                if message["type"] == "http.response.start":
                    started = True
                await send(message)

            try:
                try:
                    response = await route(request)
                except ProtocolError as exc:
                    response = await _protocol_error(request, exc)
                await response(scope, receive, start_send)
            except Exception as exc:
                response = await _internal_error(request, exc)
                if not started:
                    await response(scope, receive, send)
                raise

        return handle

    completions = generation_route(CompletionRequest, gateway.prepare_completion)
    chat_completions = generation_route(ChatCompletionRequest, gateway.prepare_chat)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.generation_routes = {
        "/v1/completions": direct(completions),
        "/v1/chat/completions": direct(chat_completions),
    }

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

    who = {} if gateway_index is None else {"gateway": gateway_index}

    @app.get("/health")
    async def health() -> Response:
        ready, reason = backend.is_ready()
        if ready:
            degraded = backend.degraded()  # serving, with an engine down or drained
            if degraded:
                return JSONResponse({"status": "degraded", "reason": degraded, **who})
            return JSONResponse({"status": "ok", **who})
        return JSONResponse({"status": "unavailable", "reason": reason, **who}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        rolling.ensure_started()
        if peers is not None:
            peers.ensure_started()
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    rolling = dashboard.install(app, backend, gateway.metrics, check_api_key, peers)
    app.state.peers = peers

    add_admin_routes(app, backend, admin_api_key)
    return app


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
