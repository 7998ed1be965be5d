"""``tandem serve``: Ray pools + router + OpenAI gateway in one command.

    tandem serve --model smollm2 --prefill 1 --decode 1       # disaggregated (default)
    tandem serve --colocated 2                                 # no disaggregation
    tandem serve --decode-max-num-seqs 256 --prefill-max-num-batched-tokens 8192
    tandem serve --config serve.yaml                           # same keys, YAML

The gateway runs in this process (the Ray driver); engines are Ray actors.
Ctrl-C stops the gateway, the engines and the Ray instance this command started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Any

from cluster.cli.settings import (
    SERVE_DEFAULTS,
    api_config,
    cluster_secret,
    gateway_limits,
    migration_policy,
    pool_specs,
    resolve_settings,
)
from cluster.engines.placement import add_placement_arguments, check_pools_split_model
from cluster.routing.settings import add_routing_arguments, routing_config
from workers.config import add_engine_arguments

logger = logging.getLogger("tandem.serve")


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API with Ray engine pools")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="'smollm2' (default), 'tiny', a .gguf file, a local directory or a hub id"
    )
    p.add_argument("--prefill", type=int, help="prefill engines (default 1)")
    p.add_argument("--decode", type=int, help="decode engines (default 1)")
    p.add_argument("--colocated", type=int, help="colocated engines (replaces prefill/decode)")
    p.add_argument("--host", help="gateway host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gateway port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--address", help="Ray address to join (default: start a local Ray)")
    p.add_argument("--config", help="YAML file with the same keys (CLI wins)")
    p.add_argument(
        "--disagg-min-tokens",
        type=int,
        help="prompts with fewer tokens prefill on the decode engine (default 0)",
    )
    p.add_argument("--max-restarts", type=int, help="Ray restarts per engine actor (default 3)")
    p.add_argument(
        "--num-gpus-per-engine",
        type=float,
        help="GPUs per engine (0 = CPU; 0.5 = two engines share a GPU)",
    )
    p.add_argument("--kv-lease-s", type=float, help="prefill-side KV lease (default 60)")
    p.add_argument("--load-failure-policy", choices=["recompute", "fail"])
    p.add_argument(
        "--max-request-body-mb", type=float, help="larger request bodies get 413 (default 8)"
    )
    p.add_argument(
        "--max-num-requests",
        type=int,
        help="concurrent requests; more get 503 + Retry-After (default 0 = no cap)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        help="per-request deadline: aborted on the engines, 504 / error event (default 600, 0 = none)",
    )
    p.add_argument(
        "--engine-dead-after-s",
        type=float,
        help="an engine without a heartbeat this long is dead: its requests fail (default 30)",
    )
    p.add_argument(
        "--max-queued-outputs",
        type=int,
        help="undelivered outputs of one stream before it is cut (client not reading; default 512)",
    )
    p.add_argument(
        "--tokenizer-workers", type=int, help="threads that tokenize prompts (default 2)"
    )
    p.add_argument(
        "--max-logprobs", type=int, help="cap of logprobs / top_logprobs per token (default 20)"
    )
    p.add_argument(
        "--check-config",
        action="store_true",
        help="validate flags + YAML, print the resolved config and exit (0 ok, 2 bad)",
    )
    p.add_argument(
        "--cluster-secret-file",
        help="file holding the secret of the internal planes (>= 16 bytes; "
        "default: a fresh random secret per `tandem serve`)",
    )
    p.add_argument(
        "--no-internal-auth",
        dest="internal_auth",
        action="store_false",
        default=None,
        help="development only: engine sockets and the KV side channel accept "
        "anyone who can reach them (no CURVE)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        help="model names clients may send (the first is reported; default: --model)",
    )
    p.add_argument("--chat-template", help="Jinja chat template file (replaces the tokenizer's)")
    p.add_argument(
        "--generation-config",
        help="sampling defaults: 'auto' (the checkpoint's generation_config.json, default), "
        "'vllm' (ignore it) or a directory holding one",
    )
    add_routing_arguments(p)
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="gateway and engine logs: text (default) or one JSON object a line",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        help="export one OpenTelemetry trace per request over OTLP/HTTP to this URL "
        "(http://collector:4318 gets /v1/traces; default: off)",
    )
    p.add_argument(
        "--ray-namespace",
        help="Ray namespace of the named engine actors prefill-<i>/decode-<i>/colocated-<i> "
        "(default tandem; give each service on one Ray cluster its own)",
    )
    p.add_argument(
        "--no-migration",
        dest="migration",
        action="store_false",
        default=None,
        help="a stream whose decode engine dies ends with an error instead of moving on",
    )
    p.add_argument("--max-migrations", type=int, help="migrations per request (default 3)")
    p.add_argument(
        "--migration-handoff-min-tokens",
        type=int,
        help="migrated contexts this long get KV from a prefill engine, shorter are "
        "recomputed on decode (default 256)",
    )
    p.add_argument(
        "--migration-wait-s",
        type=float,
        help="how long a migrating stream waits for a ready engine (default 30)",
    )
    p.add_argument(
        "--admin-api-key",
        help="opens POST /admin/drain and /admin/undrain with 'Authorization: Bearer KEY' "
        "(default: admin API off)",
    )
    p.add_argument(
        "--detach-engines",
        action="store_true",
        default=None,
        help="start the engines as detached Ray actors that outlive this gateway "
        "(needs --address and --cluster-secret-file; stop them with tandem stop-engines)",
    )
    p.add_argument(
        "--attach",
        action="store_true",
        default=None,
        help="adopt the engines running in --ray-namespace (left by --detach-engines) "
        "instead of starting new ones; same --model and --cluster-secret-file",
    )
    add_placement_arguments(p)
    add_engine_arguments(p)
    for role in ("prefill", "decode", "colocated"):
        add_engine_arguments(p, prefix=f"{role}-")


class Service:
    """Everything ``tandem serve`` runs, startable from tests too."""

    def __init__(self, settings: dict[str, Any], per_role: dict[str, dict[str, Any]]) -> None:
        self.settings = settings
        self.per_role = per_role
        self.handles: list = []
        self.backend = None
        self.started_ray = False
        self.dashboard_url = None
        self.cluster_secret: bytes | None = None  # set by start(); tests act as members
        self.model_path: str | None = None  # set by start()
        # stop the engines at exit: not when they are meant to outlive this gateway
        self.owns_engines = not (settings.get("detach_engines") or settings.get("attach"))

    async def start(self) -> None:
        import ray

        from cluster.disagg.ray_backend import RayBackend
        from cluster.engines.actor import free_port, node_ip
        from cluster.engines.pools import start_pools
        from workers.checkpoints.model_dir import resolve_model_dir
        from workers.text.tokenizer import load_tokenizer

        if not ray.is_initialized():
            if self.settings["address"] or os.environ.get("RAY_ADDRESS"):
                # joining a cluster (--address, or inside `ray job submit`)
                ctx = ray.init(address=self.settings["address"] or None)
            else:
                ctx = ray.init(
                    include_dashboard=self.settings.get("ray_dashboard", True),
                    dashboard_host="127.0.0.1",
                )
                self.started_ray = True
            self.dashboard_url = getattr(ctx, "dashboard_url", None)
        host = node_ip() if self.settings["address"] else "127.0.0.1"
        output_addr = f"tcp://{host}:{free_port(host)}"
        self.model_path = model_path = resolve_model_dir(self.settings["model"])
        tokenizer = load_tokenizer(model_path)
        self.cluster_secret = secret = cluster_secret(self.settings)
        namespace = self.settings.get("ray_namespace") or SERVE_DEFAULTS["ray_namespace"]
        session = time.time_ns()  # newer than any gateway before (cluster/engines/attach.py)
        if self.settings.get("attach"):
            from cluster.engines.attach import adopt_engines, pool_counts
            from wire.auth import secret_fingerprint

            self.handles = adopt_engines(
                namespace, self.settings["model"], secret_fingerprint(secret)
            )
            self.settings.update(pool_counts(self.handles))
        else:
            self.handles = start_pools(
                pool_specs(self.settings, self.per_role, secret),
                output_addr,
                namespace=namespace,
                gateway_session=session,
                detached=bool(self.settings.get("detach_engines")),
            )
        self.backend = RayBackend(
            self.handles,
            tokenizer=tokenizer,
            model_name=self.settings["model"],
            output_addr=output_addr,
            disagg_min_tokens=self.settings["disagg_min_tokens"],
            cluster_secret=secret,
            engine_dead_after_s=self.settings.get("engine_dead_after_s", 30.0),
            call_timeout_s=self.settings.get("engine_call_timeout_s", 5.0),
            max_queued_outputs=self.settings.get("max_queued_outputs", 512),
            routing=routing_config(self.settings),
            migration=migration_policy(self.settings),
            gateway_session=session,
        )
        await self.backend.start()

    async def stop(self) -> None:
        import ray

        from cluster.engines.pools import stop_pools

        if self.backend is not None:
            await self.backend.close()
        if self.handles and self.owns_engines:
            stop_pools(self.handles)
        elif self.handles:
            logger.warning(
                "leaving %d engines running in Ray namespace %r (tandem stop-engines stops them)",
                len(self.handles),
                self.settings.get("ray_namespace"),
            )
        if self.started_ray:
            ray.shutdown()


async def _serve(settings: dict[str, Any], per_role: dict[str, dict[str, Any]]) -> None:
    import uvicorn

    from cluster.gateway.app import create_app
    from cluster.observability.tracing.settings import make_tracer

    svc = Service(settings, per_role)
    tracer = make_tracer(settings)
    try:
        await svc.start()
        app = create_app(
            svc.backend,
            api_key=settings["api_key"],
            limits=gateway_limits(settings),
            api=api_config(settings, svc.model_path),
            tracer=tracer,
            admin_api_key=settings["admin_api_key"],
        )
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=settings["host"],
                port=settings["port"],
                log_level="warning",
                access_log=False,
                lifespan="off",
            )
        )
        base = f"http://{settings['host']}:{settings['port']}"
        pools = ", ".join(
            f"{settings[r]} {r}" for r in ("prefill", "decode", "colocated") if settings[r]
        )
        print(f"tandem: serving {settings['model']!r} with {pools}", flush=True)
        print(f"  OpenAI API : {base}/v1", flush=True)
        print(f"  health     : {base}/health", flush=True)
        print(f"  metrics    : {base}/metrics", flush=True)
        print(f"  dashboard  : {base}/dashboard  (JSON: {base}/cluster/state)", flush=True)
        if svc.dashboard_url:
            print(f"  Ray dashboard: http://{svc.dashboard_url}", flush=True)
        await server.serve()
    finally:
        await svc.stop()
        if tracer is not None:
            tracer.shutdown()  # flush the last spans
        print("tandem: stopped", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.gateway.torch_free import bar_torch

    bar_torch()  # this process is the gateway: no torch in it (cluster/gateway/torch_free.py)
    if args.check_config:
        from cluster.cli.check_config import check_config

        return check_config(args)
    from cluster.observability.logging_setup import configure_logging

    configure_logging(getattr(args, "log_format", None) or "text")
    try:
        settings, per_role = resolve_settings(args)
        configure_logging(settings["log_format"])  # the YAML may name it
        specs = pool_specs(settings, per_role)  # validates engine configs before starting
        gateway_limits(settings)
        from workers.checkpoints.model_dir import resolve_model_dir

        # bad model: one line, exit 2 (GGUF: convert once, in a child process)
        model_path = resolve_model_dir(settings["model"])
        api_config(settings, model_path)
        check_pools_split_model(model_path, specs)
        if settings["internal_auth"] and settings["cluster_secret_file"]:
            from wire.auth import read_secret_file

            read_secret_file(settings["cluster_secret_file"])  # a bad file fails before Ray starts
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from cluster.engines.attach import AttachError

    try:
        asyncio.run(_serve(settings, per_role))
    except KeyboardInterrupt:
        pass
    except AttachError as exc:  # --attach found nothing it may adopt
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


class ServiceThread:
    """The whole service (Ray pools, backend, gateway) on a background event
    loop, for tests and benchmarks::

        with ServiceThread(settings, per_role) as svc:
            httpx.get(svc.base_url + "/health")
            svc.run(svc.service.backend.call_all("check_integrity"))
    """

    def __init__(
        self,
        settings: dict[str, Any],
        per_role: dict[str, dict[str, Any]],
        start_timeout_s: float = 300.0,
        tracer: Any = None,
    ) -> None:
        """``tracer``: a ``cluster.observability.tracing`` tracer (tests pass one with an
        in-memory exporter); None = built from ``otlp_traces_endpoint``."""
        import socket
        import threading

        from cluster.observability.tracing.settings import make_tracer

        self.service = Service(settings, per_role)
        self.tracer = tracer if tracer is not None else make_tracer(settings)
        self.start_timeout_s = start_timeout_s
        self.loop = asyncio.new_event_loop()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((settings.get("host") or "127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __enter__(self) -> ServiceThread:
        import uvicorn

        from cluster.gateway.app import create_app

        self._thread.start()
        try:
            self.run(self.service.start(), self.start_timeout_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        settings = self.service.settings
        app = create_app(
            self.service.backend,
            api_key=settings.get("api_key"),
            limits=gateway_limits(settings),
            api=api_config(settings, self.service.model_path),
            tracer=self.tracer,
            admin_api_key=settings.get("admin_api_key"),
        )
        self._server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        )
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._serve_future = asyncio.run_coroutine_threadsafe(
            self._server.serve(sockets=[self._sock]), self.loop
        )
        import time

        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._serve_future.done() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._server is not None:
            self._server.should_exit = True
            try:
                self._serve_future.result(15)
            except Exception:  # noqa: BLE001
                pass
        try:
            self.run(self.service.stop(), 60)
        finally:
            if self.tracer is not None:
                self.tracer.shutdown()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self._sock.close()
