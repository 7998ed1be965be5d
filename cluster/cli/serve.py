"""``tandem serve``: Ray pools + router + OpenAI gateway in one command.

    tandem serve --model smollm2 --prefill 1 --decode 1       # disaggregated (default)
    tandem serve --colocated 2                                 # no disaggregation
    tandem serve --decode-max-num-seqs 256 --prefill-max-num-batched-tokens 8192
    tandem serve --config serve.yaml                           # same settings, YAML

Every flag and YAML key is a field of ``ServeConfig`` (cluster/cli/config/).

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

from tandem.cluster.cli.config.args import add_serve_arguments
from tandem.cluster.cli.settings import (
    ServeConfig,
    api_config,
    cluster_secret,
    pool_specs,
    resolve_config,
    with_pool_counts,
)
from tandem.cluster.engines.placement import check_pools_split_model

logger = logging.getLogger("tandem.serve")


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI API with Ray engine pools",
        usage="%(prog)s [--config FILE.yaml] [--check-config] [options]",
    )
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


class Service:
    """Everything ``tandem serve`` runs, startable from tests too."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self._handles: list = []  # the engines at start (--attach: those found)
        self.backend = None
        self.started_ray = False
        self.dashboard_url = None
        self.planner_task = None  # --planner load|sla (cluster/cli/planning.py)
        self.cluster_secret: bytes | None = None  # set by start(); tests act as members
        self.model_path: str | None = None  # set by start()
        # stop the engines at exit: not when they are meant to outlive this gateway
        self.owns_engines = not (config.ray.detach_engines or config.ray.attach)

    @property
    def handles(self) -> list:
        """The engines of the pools now (they grow and shrink: cluster/disagg/scaling.py)."""
        if self.backend is not None:
            return [e.handle for e in self.backend.engines.values()]
        return self._handles

    async def start(self) -> None:
        import ray

        from tandem.cluster.disagg.ray_backend import RayBackend
        from tandem.cluster.engines.actor import free_port, node_ip
        from tandem.cluster.engines.pools import start_pools
        from tandem.workers.checkpoints.hf_config import plain_config
        from tandem.workers.checkpoints.model_dir import resolve_model_dir
        from tandem.workers.text.tokenizer import load_tokenizer

        config = self.config
        if not ray.is_initialized():
            if config.ray.address or os.environ.get("RAY_ADDRESS"):
                # joining a cluster (--address, or inside `ray job submit`)
                ctx = ray.init(address=config.ray.address or None)
            else:
                ctx = ray.init(
                    include_dashboard=config.ray.ray_dashboard, dashboard_host="127.0.0.1"
                )
                self.started_ray = True
            self.dashboard_url = getattr(ctx, "dashboard_url", None)
        host = node_ip() if config.ray.address else "127.0.0.1"
        output_addr = f"tcp://{host}:{free_port(host)}"
        self.model_path = model_path = resolve_model_dir(config.model)
        tokenizer = load_tokenizer(model_path)
        self.cluster_secret = secret = cluster_secret(config)
        namespace = config.ray.ray_namespace
        session = time.time_ns()  # newer than any gateway before (cluster/engines/attach.py)
        if config.ray.attach:
            from tandem.cluster.engines.attach import adopt_engines, pool_counts
            from tandem.wire.auth import secret_fingerprint

            self._handles = adopt_engines(namespace, config.model, secret_fingerprint(secret))
            self.config = config = with_pool_counts(config, pool_counts(self._handles))
        else:
            specs = pool_specs(config, secret)
            model_config = plain_config(model_path)  # read once here, handed to every engine
            for spec in specs:
                spec.model_config = model_config
            self._handles = start_pools(
                specs,
                output_addr,
                namespace=namespace,
                gateway_session=session,
                detached=config.ray.detach_engines,
            )
        backend = RayBackend(
            self._handles,
            tokenizer=tokenizer,
            model_name=config.model,
            output_addr=output_addr,
            disagg_min_tokens=config.routing.disagg_min_tokens,
            cluster_secret=secret,
            engine_dead_after_s=config.health.engine_dead_after_s,
            call_timeout_s=config.health.engine_call_timeout_s,
            max_queued_outputs=config.limits.max_queued_outputs,
            routing=config.routing,
            migration=config.migration,
            gateway_session=session,
            pool_sizes=config.pools.reach(),
        )
        if not config.ray.attach:  # pools that resize while serving
            from tandem.cluster.disagg.scaling import PoolScaler

            backend.scaler = PoolScaler(
                backend,
                specs,
                config.pools,
                output_addr=output_addr,
                namespace=namespace,
                gateway_session=session,
                detached=config.ray.detach_engines,
                moves_off=config.pool_moves_off(),
            )
        self.backend = backend
        await backend.start()
        from tandem.cluster.cli.planning import start_planner

        self.planner_task = start_planner(config, backend)

    async def stop(self) -> None:
        import ray

        from tandem.cluster.cli.gateways import gateway_index
        from tandem.cluster.engines.pools import stop_pools

        handles = self.handles
        if self.planner_task is not None:
            self.planner_task.cancel()
            await asyncio.gather(self.planner_task, return_exceptions=True)
        if self.backend is not None:
            await self.backend.close()
        if handles and self.owns_engines:
            stop_pools(handles)
        elif handles and gateway_index() is None:  # else the supervisor owns them
            logger.warning(
                "leaving %d engines running in Ray namespace %r (tandem stop-engines stops them)",
                len(handles),
                self.config.ray.ray_namespace,
            )
        if self.started_ray:
            ray.shutdown()


async def _serve(config: ServeConfig) -> None:
    import uvicorn

    from tandem.cluster.cli.gateways import gateway_index, reuse_port_socket
    from tandem.cluster.gateway.app import create_app
    from tandem.cluster.gateway.heap import freeze_startup_heap
    from tandem.cluster.observability.gateway_peers import SHARE_DIR_ENV
    from tandem.cluster.observability.tracing.settings import make_tracer

    svc = Service(config)
    tracer = make_tracer(config.observability)
    index = gateway_index()
    try:
        await svc.start()
        config = svc.config  # --attach: the pools found
        app = create_app(
            svc.backend,
            api_key=config.security.api_key,
            limits=config.limits,
            api=api_config(config, svc.model_path),
            tracer=tracer,
            admin_api_key=config.security.admin_api_key,
            gateway_index=index,
            share_dir=os.environ.get(SHARE_DIR_ENV) if index is not None else None,
        )
        host, port = config.server.host, config.server.port
        freeze_startup_heap()  # the collector then walks only what serving allocates
        server = uvicorn.Server(
            uvicorn.Config(
                app, host=host, port=port, log_level="warning", access_log=False, lifespan="off"
            )
        )
        if index is not None:  # one of --api-server-count's gateways (cluster/cli/gateways.py)
            if app.state.peers is not None:
                app.state.peers.ensure_started()
                # the router adds the other gateways' in-flight counts (cluster/routing/peer_load.py)
                svc.backend.routing.share_load(app.state.peers.directory, index)
            sock = reuse_port_socket(host, port)
            print(f"tandem: gateway {index} serving (pid {os.getpid()})", flush=True)
            await server.serve(sockets=[sock])
            return
        base = f"http://{host}:{port}"
        pools = ", ".join(f"{n} {r}" for r, n in config.pools.sizes().items() if n)
        print(f"tandem: serving {config.model!r} with {pools}", flush=True)
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


def run_event_loop(coro: Any) -> Any:
    """Run the gateway's event loop: on uvloop when it is installed (the
    ``fast`` extra: with httptools, which uvicorn then picks itself, about a
    third less CPU per streamed token), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def server_stack() -> str:
    """The HTTP stack ``tandem serve`` runs on (benchmarks print it)."""
    import importlib.util

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"uvicorn {http} + {loop}"


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.cluster.gateway.torch_free import bar_torch

    bar_torch()  # this process is the gateway: no torch in it (cluster/gateway/torch_free.py)
    if args.check_config:
        from tandem.cluster.cli.check_config import check_config

        return check_config(args)
    from tandem.cluster.observability.logging_setup import configure_logging

    configure_logging(getattr(args, "log_format", None) or "text")
    try:
        config = resolve_config(args)  # validates every section and pool engine
        configure_logging(config.observability.log_format)  # the YAML may name it
        specs = pool_specs(config)
        from tandem.workers.checkpoints.model_dir import resolve_model_dir

        # bad model: one line, exit 2 (GGUF: convert once, in a child process)
        model_path = resolve_model_dir(config.model)
        api_config(config, model_path)
        check_pools_split_model(model_path, specs)
        security = config.security
        if security.internal_auth and security.cluster_secret_file:
            from tandem.wire.auth import read_secret_file

            read_secret_file(security.cluster_secret_file)  # a bad file fails before Ray starts
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tandem.cluster.engines.attach import AttachError

    if config.server.api_server_count > 1:
        from tandem.cluster.cli.gateways import serve_gateways

        try:
            return serve_gateways(config, sys.argv[1:])
        except ValueError as exc:  # e.g. engine names taken in --ray-namespace
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        run_event_loop(_serve(config))
    except KeyboardInterrupt:
        pass
    except AttachError as exc:  # --attach found nothing it may adopt
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


class ServiceThread:
    """The whole service (Ray pools, backend, gateway) on a background event
    loop, for tests and benchmarks::

        with ServiceThread(serve_config(model="tiny", colocated=1)) as svc:
            httpx.get(svc.base_url + "/health")
            svc.run(svc.service.backend.call_all("check_integrity"))
    """

    def __init__(
        self,
        config: ServeConfig,
        start_timeout_s: float = 300.0,
        tracer: Any = None,
    ) -> None:
        """``config``: e.g. ``serve_config(model="tiny", max_num_seqs=16)``
        (cluster.cli.settings); ``tracer``: a ``cluster.observability.tracing``
        tracer (tests pass one with an in-memory exporter); None = built from
        ``otlp_traces_endpoint``."""
        import socket
        import threading

        from tandem.cluster.observability.tracing.settings import make_tracer

        self.service = Service(config)
        self.tracer = tracer if tracer is not None else make_tracer(config.observability)
        self.start_timeout_s = start_timeout_s
        self.loop = asyncio.new_event_loop()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((config.server.host or "127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __enter__(self) -> ServiceThread:
        import uvicorn

        from tandem.cluster.gateway.app import create_app

        self._thread.start()
        try:
            self.run(self.service.start(), self.start_timeout_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        config = self.service.config
        app = create_app(
            self.service.backend,
            api_key=config.security.api_key,
            limits=config.limits,
            api=api_config(config, self.service.model_path),
            tracer=self.tracer,
            admin_api_key=config.security.admin_api_key,
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
